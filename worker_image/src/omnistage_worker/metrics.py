"""Prometheus metrics of one worker (served on ``--metrics-port`` by :mod:`.metrics_serve`).

Each worker has its own registry (several workers may share a process in tests). Counters and
histograms are recorded where things happen (a served request, an Ack, a released hold); the
state, queues and device memory are read when Prometheus scrapes (:class:`_Live`, on the
worker's event loop), so a scrape always sees the worker as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from omnistage.worker.v1 import inference_service_pb2, types_pb2

if TYPE_CHECKING:
    from omnistage_worker.control.worker_parts import WorkerReadings

__all__ = ["EXPORTED", "WorkerMetrics"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_TRANSITION_SECONDS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_STATES = ("LOADING", "ACTIVE", "SLEEPING", "ASLEEP", "WAKING", "FAILED")

TextReceiver = Callable[[inference_service_pb2.TextChunk], None]

# Every metric family a worker exports (the chart's dashboard and alerts may use only these;
# tests/unit/test_observability_chart.py checks it).
EXPORTED = frozenset(
    {
        "omnistage_worker_info",
        "omnistage_worker_state",
        "omnistage_worker_sleep_level",
        "omnistage_worker_held_requests",
        "omnistage_worker_queued_requests",
        "omnistage_worker_inflight_requests",
        "omnistage_worker_device_memory_used_bytes",
        "omnistage_worker_device_memory_free_bytes",
        "omnistage_worker_device_memory_total_bytes",
        "omnistage_worker_peak_active_bytes",
        "omnistage_worker_last_ack_freed_bytes",
        "omnistage_worker_requests_total",
        "omnistage_worker_request_seconds",
        "omnistage_worker_generated_tokens_total",
        "omnistage_worker_prompt_tokens_total",
        "omnistage_worker_batch_size",
        "omnistage_worker_time_to_first_token_seconds",
        "omnistage_worker_generate_seconds",
        "omnistage_worker_hold_seconds",
        "omnistage_worker_transitions_total",
        "omnistage_worker_transition_seconds",
        "omnistage_worker_drain_seconds",
    }
)


class WorkerMetrics:
    """The worker's metrics and the calls that record them."""

    def __init__(self, worker: WorkerReadings) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "omnistage_worker_requests",
            "Requests answered, by protocol (grpc, http), route and status (gRPC code name or "
            "HTTP status).",
            ["protocol", "route", "status"],
            registry=r,
        )
        self.request_seconds = Histogram(
            "omnistage_worker_request_seconds",
            "Time from a request's arrival to its answer (a stream: to its end), holding and "
            "queueing included.",
            ["protocol", "route"],
            buckets=_SECONDS,
            registry=r,
        )
        self.generated_tokens = Counter(
            "omnistage_worker_generated_tokens", "Tokens generated (AR stages).", registry=r
        )
        self.prompt_tokens = Counter(
            "omnistage_worker_prompt_tokens", "Prompt tokens of served requests.", registry=r
        )
        self.batch_size = Histogram(
            "omnistage_worker_batch_size",
            "Requests the engine ran together with each served request, itself included.",
            buckets=_BATCH,
            registry=r,
        )
        self.first_token_seconds = Histogram(
            "omnistage_worker_time_to_first_token_seconds",
            "Time from a streamed request's arrival to its first generated tokens.",
            buckets=_SECONDS,
            registry=r,
        )
        self.generate_seconds = Histogram(
            "omnistage_worker_generate_seconds",
            "Time the model spent on each served request.",
            buckets=_SECONDS,
            registry=r,
        )
        self.hold_seconds = Histogram(
            "omnistage_worker_hold_seconds",
            "Time a request of an OnDemand stage was held until the stage was awake.",
            buckets=_SECONDS,
            registry=r,
        )
        self.transitions = Counter(
            "omnistage_worker_transitions",
            "Sleeps and wake-ups acknowledged (replays not counted), by operation and result "
            "(ok, noop, failed, out_of_memory).",
            ["operation", "result"],
            registry=r,
        )
        self.transition_seconds = Histogram(
            "omnistage_worker_transition_seconds",
            "Time a sleep or wake-up took inside the worker (its drain not included).",
            ["operation"],
            buckets=_TRANSITION_SECONDS,
            registry=r,
        )
        self.drain_seconds = Histogram(
            "omnistage_worker_drain_seconds",
            "Time a sleep waited for in-flight requests before it began.",
            buckets=_TRANSITION_SECONDS,
            registry=r,
        )
        r.register(_Live(worker))

    def served(self, response: inference_service_pb2.GenerateResponse) -> None:
        """A request the model answered: its tokens, batch and model time."""
        self.generated_tokens.inc(response.usage.completion_tokens)
        self.prompt_tokens.inc(response.usage.prompt_tokens)
        if response.batch_size > 0:
            self.batch_size.observe(response.batch_size)
        self.generate_seconds.observe(response.duration.ToNanoseconds() / 1e9)

    def first_token(self, receiver: TextReceiver | None, arrived: float) -> TextReceiver | None:
        """``receiver`` that also observes the time to the first chunk with tokens (monotonic
        ``arrived``); None stays None (a request that streams nothing is not timed)."""
        if receiver is None:
            return None
        seen = False

        def receive(chunk: inference_service_pb2.TextChunk) -> None:
            nonlocal seen
            if not seen and chunk.token_ids:
                seen = True
                self.first_token_seconds.observe(time.monotonic() - arrived)
            receiver(chunk)

        return receive

    def acked(self, ack: types_pb2.Ack) -> None:
        """A sleep's or wake-up's Ack (the first one for its task id, not a replay)."""
        operation = "sleep" if ack.operation == types_pb2.OPERATION_SLEEP else "wake_up"
        if ack.ok:
            result = "noop" if ack.noop else "ok"
        else:
            result = "out_of_memory" if ack.needed_bytes > 0 else "failed"
        self.transitions.labels(operation, result).inc()
        if not ack.noop:
            self.transition_seconds.labels(operation).observe(ack.duration.ToNanoseconds() / 1e9)
        if ack.HasField("drain_started_at"):
            self.drain_seconds.observe(ack.drain_duration.ToNanoseconds() / 1e9)

    def answered(self, protocol: str, route: str, status: str, seconds: float) -> None:
        """One request answered (any outcome)."""
        self.requests.labels(protocol, route, status).inc()
        self.request_seconds.labels(protocol, route).observe(seconds)


class _Live(Collector):
    """Gauges read from the worker at scrape time."""

    def __init__(self, worker: WorkerReadings) -> None:
        self.worker = worker

    def collect(self) -> Iterator[Metric]:
        w = self.worker
        ident = w.identity
        info = GaugeMetricFamily(
            "omnistage_worker_info",
            "The worker's stage, runner, backend and activation policy (always 1).",
            labels=["stage", "runner", "backend", "activation"],
        )
        info.add_metric([ident.stage, w.config.runner, w.config.backend, w.demand.policy], 1)
        yield info
        state = GaugeMetricFamily(
            "omnistage_worker_state", "1 for the worker's current state.", labels=["state"]
        )
        now = types_pb2.WorkerState.Name(w.state).removeprefix("WORKER_STATE_")
        for name in _STATES:
            state.add_metric([name], 1.0 if name == now else 0.0)
        yield state
        yield _gauge("omnistage_worker_sleep_level", "Sleep level now (0: awake).", w.level)
        yield _gauge(
            "omnistage_worker_held_requests",
            "Requests held until the stage wakes (OnDemand).",
            w.demand.held,
        )
        yield _gauge(
            "omnistage_worker_queued_requests",
            "Admitted requests waiting for the model to take them.",
            len(w.queued),
        )
        yield _gauge(
            "omnistage_worker_inflight_requests",
            "Admitted requests not finished (queued or running).",
            w.inflight,
        )
        yield _gauge(
            "omnistage_worker_peak_active_bytes",
            "Most device memory measured while Active since the last wake or load.",
            w.peak_active,
        )
        yield from _memory(w)
        ack = w.last_ack
        if ack is not None:
            freed = GaugeMetricFamily(
                "omnistage_worker_last_ack_freed_bytes",
                "Device bytes the last Ack measured as freed (negative for a wake-up).",
                labels=["operation"],
            )
            freed.add_metric([types_pb2.Operation.Name(ack.operation)], ack.freed_bytes)
            yield freed


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


def _memory(worker: WorkerReadings) -> Iterator[Metric]:
    """Per-device memory, measured now (the last measurement while a transition runs)."""
    reading = worker.snapshot()
    if reading is None:
        return
    families: dict[str, Any] = {}
    for field, what in (("used", "this worker uses"), ("free", "free"), ("total", "in all")):
        families[field] = GaugeMetricFamily(
            f"omnistage_worker_device_memory_{field}_bytes",
            f"Device memory {what}, per device.",
            labels=["device", "uuid"],
        )
    for d in reading.devices:
        for field, family in families.items():
            family.add_metric([d.device, d.uuid], getattr(d, field))
    yield from families.values()
