"""One transition of a ``gpus: 2`` stage as ``bench/multi_gpu.py`` records it: the Sleep or WakeUp
ACK's per-device figures, NVML's per-process figures read from outside, and the rates per device."""

from __future__ import annotations

import time
import uuid
from typing import Any

from bench.worker_grpc import Worker
from omnistage.worker.v1 import sleep_service_pb2, types_pb2

Json = dict[str, Any]


DEVICES = 2


class Nvml:
    """Per device: free memory and each process's memory, as nvidia-smi shows them."""

    def __init__(self) -> None:
        import pynvml

        self.nvml: Any = pynvml
        pynvml.nvmlInit()
        self.handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(DEVICES)]

    def free(self) -> list[int]:
        return [int(self.nvml.nvmlDeviceGetMemoryInfo(h).free) for h in self.handles]

    def processes(self) -> list[dict[int, int]]:
        """Per device: pid -> used bytes (host pids: they may differ from ours in a container)."""
        out = []
        for h in self.handles:
            procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(h)
            out.append({int(p.pid): int(p.usedGpuMemory or 0) for p in procs})
        return out


def devices_json(ack: types_pb2.Ack) -> list[Json]:
    return [
        {
            "device": d.device,
            "uuid": d.uuid,
            "used_before_bytes": d.used_before_bytes,
            "used_after_bytes": d.used_after_bytes,
            "freed_bytes": d.freed_bytes,
            "free_before_bytes": d.free_before_bytes,
            "free_after_bytes": d.free_after_bytes,
        }
        for d in ack.devices
    ]


def transition(worker: Worker, op: str, level: int, nvml: Nvml | None) -> Json:
    """One Sleep or WakeUp; the Ack with per-device figures, and NVML read from outside."""
    task = str(uuid.uuid4())
    if op == "sleep":
        level_enum = types_pb2.SleepLevel.ValueType(level)
        sleep_request = sleep_service_pb2.SleepRequest(task_id=task, level=level_enum)
        ack = worker.sleep.Sleep(sleep_request, timeout=600).ack
    else:
        wake_request = sleep_service_pb2.WakeUpRequest(task_id=task)
        ack = worker.sleep.WakeUp(wake_request, timeout=600).ack
    out: Json = {
        "op": op,
        "level": level,
        "ok": ack.ok,
        "error": ack.error,
        "state": types_pb2.WorkerState.Name(ack.state),
        "worker_seconds": ack.duration.ToTimedelta().total_seconds(),
        "bytes_moved": ack.bytes_moved,
        "devices": devices_json(ack),
    }
    if nvml is not None:
        # NVML's per-process figures on each device just after the ACK, from outside; the
        # worker's own figure must be one of them (its pid may be renumbered in a container)
        out["nvml_processes_after"] = [sorted(procs.values()) for procs in nvml.processes()]
    return out


def per_device_rates(t: Json, per_device_bytes: list[int]) -> list[float]:
    """GB/s of each device's own bytes over the transition (the devices copy at once)."""
    seconds = t["worker_seconds"]
    return [b / seconds / 1e9 if seconds else 0.0 for b in per_device_bytes]


def stage_bytes(cycles: list[Json], stage: str) -> list[int]:
    """Each device's share of a stage: what its wakes took there (the flat buffer)."""
    wakes = [c[f"{stage}_wake"] for c in cycles]
    return [max(-w["devices"][i]["freed_bytes"] for w in wakes) for i in range(DEVICES)]


def wait_asleep(worker: Worker) -> Json:
    deadline = time.monotonic() + 900
    while True:
        status = worker.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)
        if status.state == types_pb2.WORKER_STATE_ASLEEP or time.monotonic() > deadline:
            return {
                "state": types_pb2.WorkerState.Name(status.state),
                "devices": [(d.device, d.uuid, d.used_after_bytes) for d in status.devices],
            }
        time.sleep(0.2)
