"""GetStatus: everything the worker reports about itself, measured now."""

from __future__ import annotations

from typing import TYPE_CHECKING

from omnistage.worker.v1 import sleep_service_pb2
from omnistage_worker.control.acks import device_figures, identity_proto, level_proto
from omnistage_worker.control.component_sleep import component_memory
from omnistage_worker.control.overlap import claim_limit_refusal
from omnistage_worker.engine.handoff import handoff_refusal

if TYPE_CHECKING:
    from omnistage_worker.control.worker_parts import WorkerReadings


def planned_weights(worker: WorkerReadings) -> list[int]:
    """The weight bytes the device map places on each device, in the order the worker measures
    its devices (one engine per device, in device order), resident or asleep."""
    from omnistage_worker.engine.sharded import ShardedEngine

    controller = worker.controller
    if controller is None:
        return []
    if isinstance(controller, ShardedEngine):
        return [shard.weights_bytes for shard in controller.shards]
    return [int(controller.weights_bytes)]


def build_status(worker: WorkerReadings) -> sleep_service_pb2.GetStatusResponse:
    """The GetStatus answer: state, model, measured memory (fresh when idle), last Ack."""
    config = worker.config
    reading = worker.snapshot()
    response = sleep_service_pb2.GetStatusResponse(
        state=worker.state,
        level=level_proto(worker.level),
        model=str(config.model),
        runner=worker.runner.runner_kind,
        backend=worker.runner.backend_kind,
        worker=identity_proto(worker.identity),
        weights_bytes=worker.controller.weights_bytes if worker.controller else 0,
        active_footprint_bytes=worker.active_footprint,
        error=worker.error,
        inflight_requests=worker.inflight,
        peak_active_bytes=worker.peak_active,
        context_bytes=worker.baseline,
        epoch=worker.epoch,
    )
    if reading is not None:
        response.used_bytes = reading.used
        response.free_bytes = reading.free
        response.total_bytes = reading.total
        response.source = reading.source
        # Per device, "before" and "after" are both now (nothing moved, nothing freed).
        response.devices.extend(device_figures(reading, reading))
        for figures, weights in zip(response.devices, planned_weights(worker), strict=False):
            figures.weights_bytes = weights
        response.claim_limits = not claim_limit_refusal(worker, reading, active=False)
        response.handoff = not handoff_refusal()
    response.drain_timeout.FromNanoseconds(int(config.drain_timeout_s * 1e9))
    if worker.last_ack is not None:
        response.last_ack.CopyFrom(worker.last_ack)
    response.components.extend(component_memory(worker.controller))
    response.sequential = worker.config.sequential
    return response
