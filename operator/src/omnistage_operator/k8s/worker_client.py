"""grpc.aio client of a worker's SleepService: a deadline on every call, bearer token, optional TLS.

Retries are the caller's business (the worker replays the first ACK for a repeated id). RPC
failures are classified: a deliberate answer (FAILED_PRECONDITION, INVALID_ARGUMENT,
RESOURCE_EXHAUSTED, PERMISSION_DENIED) is ``WorkerRefused`` with the code's name and the worker's
message; UNAUTHENTICATED is ``WorkerUnauthenticated``; silence (UNAVAILABLE, DEADLINE_EXCEEDED and
every other code) is ``WorkerUnavailable``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf import duration_pb2

from omnistage.worker.v1 import (
    demand_service_pb2,
    demand_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)
from omnistage_operator.decisions.facts import (
    AckFacts,
    RoomBeside,
    WorkerReport,
    ack_from_proto,
    report_from_proto,
)
from omnistage_operator.decisions.handover import (
    WorkerRefused,
    WorkerUnauthenticated,
    WorkerUnavailable,
)

__all__ = ["WorkerClient"]

_LEVELS = {1: types_pb2.SLEEP_LEVEL_OFFLOAD, 2: types_pb2.SLEEP_LEVEL_DISCARD}
# Codes a worker answers on purpose: not silence, so never retried as if the call was lost.
REFUSALS = frozenset(
    {
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.PERMISSION_DENIED,
    }
)


class WorkerClient:
    """One channel to one worker (``host:port``)."""

    def __init__(
        self,
        target: str,
        *,
        token: str | Callable[[], str | None] | None = None,
        ca_pem: bytes | None = None,
        server_name: str | None = None,
        tls: bool = False,
    ):
        """``token``: the bearer token, or a callable giving the current one per call.
        ``server_name``: with TLS, the name the worker's certificate must carry (the operator
        dials pod IPs, which change; certificates name the stage's Service instead). TLS when
        ``ca_pem`` is given (that CA) or ``tls`` is true (the system's roots without one)."""
        tls = tls or ca_pem is not None
        self.target = target
        options: list[tuple[str, int | str]] = [
            ("grpc.enable_retries", 0),
            ("grpc.max_reconnect_backoff_ms", 1000),
        ]
        if tls and server_name:
            options.append(("grpc.ssl_target_name_override", server_name))
        if tls:
            creds = grpc.ssl_channel_credentials(root_certificates=ca_pem)
            self._channel = grpc.aio.secure_channel(target, creds, options=options)
        else:
            self._channel = grpc.aio.insecure_channel(target, options=options)
        self._stub = sleep_service_pb2_grpc.SleepServiceStub(self._channel)
        self._demand = demand_service_pb2_grpc.DemandServiceStub(self._channel)
        self._token = token
        self.closed = False

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """The bearer token of this call (a callable one is asked each time: it rotates)."""
        token = self._token() if callable(self._token) else self._token
        return (("authorization", f"Bearer {token}"),) if token else ()

    async def close(self) -> None:
        """Close the channel (its RPCs in flight end CANCELLED)."""
        self.closed = True
        await self._channel.close()

    def _error(self, what: str, exc: grpc.aio.AioRpcError) -> Exception:
        """The exception an RPC error stands for (see the module docstring)."""
        if exc.code() in REFUSALS:
            return WorkerRefused(exc.code().name, exc.details() or "")
        message = f"{what} at {self.target}: {exc.code().name}: {exc.details()}"
        if exc.code() is grpc.StatusCode.UNAUTHENTICATED:
            return WorkerUnauthenticated(
                f"{message} (with the shared token: the worker was started with another token "
                "than the operator's, its pod predates the Secret omnistage-worker-token it "
                "mounts; with Kubernetes-issued tokens: the worker's reason above)"
            )
        return WorkerUnavailable(message)

    async def _unary(self, what: str, rpc: Any, request: Any, timeout_s: float) -> Any:
        """One unary call with its deadline and token; its failure as ``_error`` says."""
        try:
            return await rpc(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise self._error(what, exc) from exc

    async def get_status(self, timeout_s: float, epoch: int = 0) -> WorkerReport:
        """GetStatus with a deadline; ``epoch`` (this operator's leadership) is remembered by
        the worker, which then refuses orders from any older leader."""
        request = sleep_service_pb2.GetStatusRequest(epoch=epoch)
        resp = await self._unary("GetStatus", self._stub.GetStatus, request, timeout_s)
        return report_from_proto(resp)

    async def sleep(
        self,
        level: int,
        task_id: str,
        timeout_s: float,
        *,
        epoch: int = 0,
        drain_timeout_s: float | None = None,
        components: tuple[str, ...] = (),
    ) -> AckFacts:
        """Sleep at ``level`` (1 or 2) under ``task_id``, ordered by leadership ``epoch``;
        ``drain_timeout_s`` bounds the worker's wait for in-flight requests (None: its own);
        ``components``: only those pipeline components (the worker stays Active)."""
        req = _sleep_request(level, task_id, epoch, drain_timeout_s, components)
        resp = await self._unary(f"Sleep {task_id}", self._stub.Sleep, req, timeout_s)
        return ack_from_proto(resp.ack)

    async def wake(
        self,
        task_id: str,
        timeout_s: float,
        *,
        epoch: int = 0,
        claim_limit_bytes: int = 0,
        handoff_channel: str = "",
    ) -> AckFacts:
        """WakeUp under ``task_id``, ordered by leadership ``epoch``; ``claim_limit_bytes``
        above 0: an overlapped wake, which holds at most that much device memory until
        :meth:`raise_claim_limit` raises it, taking the pieces handed over on
        ``handoff_channel`` where it can."""
        req = sleep_service_pb2.WakeUpRequest(
            task_id=task_id,
            epoch=epoch,
            claim_limit_bytes=claim_limit_bytes,
            handoff_channel=handoff_channel,
        )
        resp = await self._unary(f"WakeUp {task_id}", self._stub.WakeUp, req, timeout_s)
        return ack_from_proto(resp.ack)

    async def sleep_stream(
        self,
        level: int,
        task_id: str,
        timeout_s: float,
        *,
        epoch: int = 0,
        handoff_channel: str = "",
    ) -> AsyncIterator[int | RoomBeside | AckFacts]:
        """SleepStream of the whole model: the room beside it where the worker measured one
        before the sleep began (first), the bytes released so far (measured, rising) after each
        piece the sleep gives back, then its ACK (the last item); its pieces handed over on
        ``handoff_channel`` (empty: freed)."""
        request = sleep_service_pb2.SleepStreamRequest(
            sleep=_sleep_request(level, task_id, epoch, None, ()),
            handoff_channel=handoff_channel,
        )
        call = self._stub.SleepStream(request, timeout=timeout_s, metadata=self._metadata)
        try:
            async for message in call:
                if message.WhichOneof("event") == "ack":
                    yield ack_from_proto(message.ack)
                elif message.released.HasField("device_free_bytes"):
                    yield RoomBeside(int(message.released.device_free_bytes))
                else:
                    yield int(message.released.released_bytes)
        except grpc.aio.AioRpcError as exc:
            raise self._error(f"SleepStream {task_id}", exc) from exc
        finally:
            call.cancel()

    async def raise_claim_limit(
        self, task_id: str, claim_limit_bytes: int, timeout_s: float, *, epoch: int = 0
    ) -> bool:
        """Raise the claim limit of the overlapped wake ``task_id``; False when none runs under
        it (it ended, or has yet to begin: the worker keeps the raise for it)."""
        req = sleep_service_pb2.RaiseClaimLimitRequest(
            task_id=task_id, claim_limit_bytes=claim_limit_bytes, epoch=epoch
        )
        what = f"RaiseClaimLimit {task_id}"
        resp = await self._unary(what, self._stub.RaiseClaimLimit, req, timeout_s)
        return bool(resp.running)

    async def watch_demand(
        self, epoch: int = 0
    ) -> AsyncIterator[demand_service_pb2.WatchDemandResponse]:
        """The worker's demand now and at every change, for as long as the caller reads (no
        deadline: the stream is long-lived; the caller cancels it)."""
        call = self._demand.WatchDemand(
            demand_service_pb2.WatchDemandRequest(epoch=epoch), metadata=self._metadata
        )
        try:
            async for message in call:
                yield message
        except grpc.aio.AioRpcError as exc:
            raise self._error("WatchDemand", exc) from exc
        finally:
            call.cancel()


def _sleep_request(
    level: int,
    task_id: str,
    epoch: int,
    drain_timeout_s: float | None,
    components: tuple[str, ...],
) -> sleep_service_pb2.SleepRequest:
    """A Sleep request at ``level`` (1 or 2)."""
    if level not in _LEVELS:
        raise ValueError(f"sleep level must be 1 or 2, got {level}")
    req = sleep_service_pb2.SleepRequest(
        task_id=task_id, level=_LEVELS[level], epoch=epoch, components=list(components)
    )
    if drain_timeout_s is not None:
        drain = duration_pb2.Duration()
        drain.FromNanoseconds(int(drain_timeout_s * 1e9))
        req.drain_timeout.CopyFrom(drain)
    return req
