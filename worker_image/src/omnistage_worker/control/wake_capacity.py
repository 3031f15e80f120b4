"""Whether a wake fits: on an accounted device (CPU, the simulated GPU) a wake that would not fit
in the free memory is refused, as a GPU would fail with out-of-memory."""

from __future__ import annotations

from omnistage.worker.v1 import types_pb2
from omnistage_worker.memory import Reading
from omnistage_worker.runners.base import SleepController


def capacity_shortfall(before: Reading, controller: SleepController) -> tuple[str, int]:
    """On an accounted device, refuse a wake that would not fit, as a GPU would OOM: the
    reason and how many bytes more it needs ("" and 0 when it fits)."""
    if before.source != types_pb2.MEMORY_SOURCE_ACCOUNTING:
        return "", 0
    # What the wake allocates: the engine's flat buffer (weights plus alignment padding).
    from omnistage_worker.engine.sharded import ShardedEngine

    if isinstance(controller, ShardedEngine) and len(before.devices) == len(controller.shards):
        short = []
        more = 0
        for device, shard in zip(before.devices, controller.shards, strict=True):
            need = shard.flat_bytes - shard.device_bytes()
            if need > device.free:
                short.append(f"{device.device} needs {need} bytes, {device.free} free")
                more += need - device.free
        if not short:
            return "", 0
        reason = "not enough free device memory to wake: " + "; ".join(short) + " (accounting)"
        return reason, more
    need = int(getattr(controller, "flat_bytes", controller.weights_bytes))
    need -= controller.device_bytes()
    if need <= before.free:
        return "", 0
    return (
        f"not enough free device memory to wake: need {need} bytes, "
        f"{before.free} free of {before.total} (accounting)"
    ), need - before.free
