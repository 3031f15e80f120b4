"""DemandService: the worker's demand streamed to the operator at every change."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from omnistage.worker.v1 import demand_service_pb2, demand_service_pb2_grpc
from omnistage_worker.control.demand import ON_DEMAND, Figures
from omnistage_worker.control.transitions import Refused, require_epoch
from omnistage_worker.state import Worker

Context = Any  # grpc.aio.ServicerContext (grpc ships no type stubs)

_POLICY = {
    ON_DEMAND: demand_service_pb2.ACTIVATION_POLICY_ON_DEMAND,
}


class DemandServicer(demand_service_pb2_grpc.DemandServiceServicer):
    """WatchDemand: the figures now, then at every change, until the caller cancels."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    async def WatchDemand(
        self, request: demand_service_pb2.WatchDemandRequest, context: Context
    ) -> AsyncIterator[demand_service_pb2.WatchDemandResponse]:
        try:
            require_epoch(request.epoch)
        except Refused as exc:
            await context.abort(exc.code, exc.message)
            return
        async for figures in self.worker.demand.watch():
            yield build_demand(self.worker, figures)


def build_demand(worker: Worker, figures: Figures) -> demand_service_pb2.WatchDemandResponse:
    """One stream message: the worker's state and its demand figures."""
    demand = worker.demand
    response = demand_service_pb2.WatchDemandResponse(
        sequence=figures.sequence,
        state=worker.state,
        policy=_POLICY.get(demand.policy, demand_service_pb2.ACTIVATION_POLICY_MANUAL),
        held_requests=figures.held,
        inflight_requests=worker.inflight,
        max_held=demand.max_held,
        held_total=figures.held_total,
        served_after_hold_total=figures.served_after_hold_total,
        hold_timeouts_total=figures.hold_timeouts_total,
        hold_full_total=figures.hold_full_total,
        hold_seconds_total=figures.hold_seconds_total,
    )
    if figures.oldest_hold_start is not None:
        response.oldest_hold_start.FromNanoseconds(int(figures.oldest_hold_start * 1e9))
    if figures.last_request is not None:
        response.last_request_time.FromNanoseconds(int(figures.last_request * 1e9))
    response.hold_timeout.FromNanoseconds(int(demand.hold_timeout * 1e9))
    return response
