"""gRPC health: "" SERVING while healthy, the inference service SERVING only while awake."""

from __future__ import annotations

from grpc_health.v1 import health, health_pb2

from omnistage.worker.v1 import types_pb2
from omnistage_worker.control.transitions import Current

OVERALL = ""
SLEEP_SERVICE = "omnistage.worker.v1.SleepService"
INFERENCE_SERVICE = "omnistage.worker.v1.InferenceService"

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def statuses(current: Current) -> dict[str, int]:
    """The health of each service for a worker state (pure)."""
    healthy = current.state != types_pb2.WORKER_STATE_FAILED
    awake = current.state == types_pb2.WORKER_STATE_ACTIVE
    return {
        OVERALL: SERVING if healthy else NOT_SERVING,
        SLEEP_SERVICE: SERVING if healthy else NOT_SERVING,
        INFERENCE_SERVICE: SERVING if awake else NOT_SERVING,
    }


class HealthReporter:
    """Keeps a grpc.health.v1 servicer in step with the worker's state."""

    def __init__(self) -> None:
        self.servicer = health.aio.HealthServicer()

    async def update(self, current: Current) -> None:
        for service, status in statuses(current).items():
            await self.servicer.set(service, status)

    async def shutdown(self) -> None:
        """Everything NOT_SERVING, for good (the first step of a graceful stop)."""
        await self.servicer.enter_graceful_shutdown()
