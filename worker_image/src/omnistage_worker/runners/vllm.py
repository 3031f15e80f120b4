"""vLLM runner: vLLM's own OpenAI server over its async engine, in the worker (vLLM 0.24).

Design. The stage's HTTP API is vLLM's OpenAI app (``build_app`` + ``init_app_state``, as
``vllm serve`` builds it, :mod:`.vllm_serve`) over vLLM's ``AsyncLLM`` engine client, served
by the worker's uvicorn on the stage's HTTP port behind a thin ASGI front of ours
(:mod:`omnistage_worker.serving.vllm_front`): continuous batching, paged KV, usage, logprobs, n,
stop, seed, tools and structured output are vLLM's own, with no extra hop per token. The front keeps
what only the worker does: it holds requests while the stage sleeps or wakes (OnDemand; 409
for a Manual stage that is not Active), never lets one into a sleeping engine, counts them in
flight so a sleep drains them first, and answers ``/health``. The alternative, ``vllm serve``
as a child process behind a proxy, would add a hop to every streamed token and a second
process whose sleep state could drift from the worker's; in-process, the gRPC SleepService
stays the one authority over the engine. gRPC Generate goes through the same engine
(:meth:`VllmRunner.agenerate`), so it batches with the HTTP traffic.

vLLM owns the weights, so the worker's weight engine is not used; vLLM is imported only when
this runner is chosen. CI runs it against the stand-in in ``tests/fakevllm`` (same call
surface, real batching and memory physics on the simulated GPU); ``bench/vllm_stage.py`` and
``bench/serving_vllm.py`` run real vLLM.

- The worker process takes no CUDA context of its own (``owns_device_context = False``): vLLM's
  engine core runs in a child process, and the probe measures that process tree with NVML
  (recognising host pids where the driver reports them: ``EngineTreeProbe.adopt_engine``).
  The stage's footprint is the engine's (weights + KV pool) as measured at start.
- ``gpu_memory_utilization`` comes from ``--vllm-*`` (``config.VllmArgs.utilization``): given,
  or the stage's memory over the device's total, or the free memory at start.
- The residual bound is derived from what the engine holds asleep, measured once at start:
  one level-1 sleep and wake right after loading (context, CUDA graphs, NCCL buffers stay).
- level 1: ``engine.sleep(1)`` offloads weights to host memory and drops the KV cache;
  ``engine.wake_up()`` brings them back. By default (``--no-vllm-fast-wake`` turns it off) the
  engine's worker runs the fast path of :mod:`.vllm_wake` (installed by the worker extension
  :mod:`.vllm_wake_cuda`): the host copy is page-locked once and kept, the copies are issued
  at once on one stream, the KV cache is mapped while they run; the kept copy counts in
  ``host_bytes`` until a level-2 sleep gives it back.
- level 2: ``engine.sleep(2)`` drops the weights too; the wake maps the weight memory
  (``wake_up(tags=["weights"])``), reloads the weights from the model directory
  (``collective_rpc("reload_weights")``), maps the KV cache (``wake_up(tags=["kv_cache"])``)
  and resets the prefix cache.
- The engine's coroutines run on the worker's event loop; Sleep and WakeUp call them from the
  transition lane through :class:`~.vllm_serve.LoopBridge`.
- 1 -> 2 while asleep is refused (``can_deepen = False``): vLLM cannot drop its host copy
  without first taking the device memory back, which could overrun another stage.
- A wake that fails (e.g. out of memory) puts the engine back to sleep at its level.
- Prompts: text when the model directory has a tokenizer; otherwise vLLM starts with
  ``skip_tokenizer_init`` and a gRPC prompt's UTF-8 bytes are its token ids (the response
  carries token ids only).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import EngineTreeProbe, MemoryProbe
from omnistage_worker.runners.base import ChunkSink, ModelRunner, SleepController
from omnistage_worker.runners.vllm_requests import response_of, sampling_kwargs
from omnistage_worker.runners.vllm_serve import (
    LoopBridge,
    build_openai_app,
    parse_serve_args,
    request_fields,
    serve_argv,
    start_engine,
)

log = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
#: Bound on one engine call made from the transition lane (sleep, wake, reload).
ENGINE_CALL_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class VllmStats:
    """Figures of a vLLM transition: ``bytes_moved`` is the weights' size when they were copied
    (level 1) or reloaded (level-2 wake); vLLM itself reports no bytes."""

    bytes_moved: int
    seconds: float
    noop: bool


def prompt_token_ids(prompt: str, vocab_size: int) -> list[int]:
    """Token ids of a prompt for a model without a tokenizer: its UTF-8 bytes (below vocab)."""
    return [b % vocab_size for b in prompt.encode("utf-8")]


def vocab_size(model_dir: Path) -> int:
    """The model's vocabulary size, from its ``config.json``."""
    config = json.loads((model_dir / "config.json").read_text())
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{model_dir / 'config.json'} has no vocab_size")
    return size


def has_tokenizer(model_dir: Path) -> bool:
    """Whether the model directory carries a tokenizer vLLM can load."""
    return any((model_dir / name).is_file() for name in TOKENIZER_FILES)


class VllmController:
    """Sleeps and wakes vLLM's async engine (``enable_sleep_mode``) from the transition lane.

    ``flat_bytes``: what a wake takes on the device (weights and KV cache), measured at start;
    an accounted device refuses a wake ahead of time when it does not fit. ``keeps_host_copy``:
    the engine runs the fast sleep/wake (:mod:`.vllm_wake`), whose host copy of the weights
    stays page-locked from a level-1 sleep until a level-2 sleep (it counts in
    :meth:`host_bytes` while awake too).
    """

    def __init__(
        self,
        engine: Any,
        bridge: LoopBridge,
        weights_bytes: int,
        wake_bytes: int = 0,
        *,
        lifespan: contextlib.AbstractAsyncContextManager[Any] | None = None,
        keeps_host_copy: bool = False,
    ) -> None:
        self._engine = engine
        self._bridge = bridge
        self._lifespan = lifespan
        self._level = 0
        self._weights_bytes = weights_bytes
        self.flat_bytes = wake_bytes or weights_bytes
        self._keeps_host_copy = keeps_host_copy
        self._host_kept = keeps_host_copy  # the start's calibration slept at level 1

    @property
    def level(self) -> int:
        return self._level

    @property
    def weights_bytes(self) -> int:
        return self._weights_bytes

    def _run(self, call: Callable[[], Any]) -> Any:
        return self._bridge.call(call(), ENGINE_CALL_TIMEOUT_S)

    def activate(self) -> VllmStats:
        return VllmStats(0, 0.0, True)  # vLLM loads onto the device when it is built

    def start_asleep(self, level: int) -> VllmStats:
        raise RuntimeError("vLLM cannot start asleep (it takes device memory while it loads)")

    def sleep(self, level: int) -> VllmStats:
        if level <= self._level:
            return VllmStats(0, 0.0, True)
        if self._level != 0:
            # vLLM has no 1 -> 2 step that does not first take the device memory back.
            raise RuntimeError("vLLM cannot go from level 1 to level 2 without waking")
        started = time.monotonic()
        # The worker drained its requests first; nothing is left for the engine to abort.
        self._run(lambda: self._engine.sleep(level))
        self._level = level
        self._host_kept = self._keeps_host_copy and level == 1
        moved = self._weights_bytes if level == 1 else 0
        return VllmStats(moved, time.monotonic() - started, False)

    def wake(self) -> VllmStats:
        if self._level == 0:
            return VllmStats(0, 0.0, True)
        started = time.monotonic()
        engine = self._engine
        try:
            if self._level == 2:
                self._run(lambda: engine.wake_up(tags=["weights"]))
                self._run(lambda: engine.collective_rpc("reload_weights"))
                self._run(lambda: engine.wake_up(tags=["kv_cache"]))
                self._run(engine.reset_prefix_cache)
            else:
                self._run(engine.wake_up)
        except Exception:
            # Part of the memory may be mapped again: give it back before reporting.
            log.warning("vLLM wake from level %d failed; back to sleep", self._level)
            level = self._level
            with contextlib.suppress(Exception):
                self._run(lambda: engine.sleep(level))
            raise
        self._level = 0
        return VllmStats(self._weights_bytes, time.monotonic() - started, False)

    def close(self) -> None:
        """End the app's lifespan, stop the engine core (its memory goes with it)."""
        if self._lifespan is not None:
            lifespan, self._lifespan = self._lifespan, None
            with contextlib.suppress(Exception):
                self._bridge.call(lifespan.__aexit__(None, None, None), ENGINE_CALL_TIMEOUT_S)
        self._engine.shutdown()

    def device_bytes(self) -> int:
        return 0  # the engine's memory is measured on the device, never accounted here

    def host_bytes(self) -> int:
        return self._weights_bytes if self._level == 1 or self._host_kept else 0


class VllmRunner(ModelRunner):
    """A causal LM served by vLLM's async engine and its OpenAI app."""

    runner_kind = types_pb2.RUNNER_AR
    backend_kind = types_pb2.BACKEND_VLLM
    can_deepen = False
    owns_device_context = False

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.engine: Any = None
        self.serve_args: Any = None
        self.app: Any = None  # vLLM's OpenAI app, once the engine is up
        self.fields: dict[str, frozenset[str]] = {}  # per checked route, what vLLM defines
        self._lifespan: contextlib.AbstractAsyncContextManager[Any] | None = None
        self.vocab_size = 0
        self.tokenizer = has_tokenizer(config.model)
        self.bridge = LoopBridge()
        self._baseline: int | None = None
        self._wake_bytes = 0
        self._ids = itertools.count()
        self._running = 0  # gRPC requests in the engine now
        self.wake_report: dict[str, Any] | None = None  # the fast sleep/wake's, after the start

    def _probe(self) -> MemoryProbe:
        if self.probe is None:
            raise RuntimeError("the vLLM runner measures with the worker's probe: none is set")
        return self.probe

    def engine_app(self) -> Any:
        """vLLM's own OpenAI app (None until the engine is up): the worker serves it behind its
        front (the gate, the drain, the held requests)."""
        return self.app

    def request_fields(self) -> dict[str, frozenset[str]]:
        """Per checked route, the fields vLLM's request model defines (empty until the engine
        is up): the front refuses any other."""
        return self.fields

    def serve_argv(self, total: int, free: int) -> list[str]:
        """The ``vllm serve`` flags for a device of ``total`` bytes with ``free`` now."""
        utilization = self.config.vllm.utilization(total, free)
        return serve_argv(self.config, utilization, self.tokenizer)

    def load(self) -> None:
        # vLLM forks its engine core by default; this process runs gRPC threads, which must
        # not be forked: spawn it (the worker's entry points are import-safe).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        probe = self._probe()
        device = min(probe.read().devices, key=lambda d: d.free)
        tree = probe if isinstance(probe, EngineTreeProbe) else None
        listed = tree.listed_pids() if tree is not None else set()
        argv = self.serve_argv(device.total, device.free)
        started = time.monotonic()
        log.info("starting vLLM's engine: vllm serve %s", " ".join(argv))
        self.serve_args = parse_serve_args(argv)
        self.engine = start_engine(self.serve_args)
        if tree is not None:
            tree.adopt_engine(listed)
        self.vocab_size = vocab_size(self.model_dir)
        self.fields = request_fields()
        self.app, self._lifespan = self.bridge.call(build_openai_app(self.engine, self.serve_args))
        log.info("vLLM loaded %s in %.2fs", self.model_dir, time.monotonic() - started)
        self._calibrate(probe)

    def _calibrate(self, probe: MemoryProbe) -> None:
        """Measure once what the engine holds asleep (context, CUDA graphs, NCCL): a level-1
        sleep and wake before the worker serves (the pod was admitted with this memory)."""
        active = probe.read().used
        started = time.monotonic()
        self.bridge.call(self.engine.sleep(1), ENGINE_CALL_TIMEOUT_S)
        asleep = probe.read().used
        self.bridge.call(self.engine.wake_up(), ENGINE_CALL_TIMEOUT_S)
        self._baseline = asleep
        self._wake_bytes = max(0, active - asleep)
        log.info(
            "vLLM holds %d bytes active (weights + KV pool + context), %d asleep (the residual "
            "baseline); calibrated in %.2fs",
            active,
            asleep,
            time.monotonic() - started,
        )
        self._read_wake_report()

    def _read_wake_report(self) -> None:
        """The fast sleep/wake's report after the calibration (its first sleep page-locked the
        host copy): logged, and kept in :attr:`wake_report` (None: the flag is off)."""
        if not self.config.vllm.fast_wake:
            return
        try:
            reports = self.bridge.call(
                self.engine.collective_rpc("omnistage_wake_report"), ENGINE_CALL_TIMEOUT_S
            )
        except Exception:
            log.warning("vLLM's worker extension did not answer its report", exc_info=True)
            return
        self.wake_report = reports[0] if reports else {}
        if self.wake_report.get("installed"):
            log.info("vLLM fast sleep/wake installed: %s", json.dumps(self.wake_report))
        else:
            log.warning("vLLM fast sleep/wake NOT installed: %s", json.dumps(self.wake_report))

    def residual_baseline(self) -> int | None:
        return self._baseline

    def build_controller(self) -> SleepController:
        weights = sum(p.stat().st_size for p in self.model_dir.glob("*.safetensors"))
        return VllmController(
            self.engine,
            self.bridge,
            weights,
            self._wake_bytes,
            lifespan=self._lifespan,
            keeps_host_copy=self.config.vllm.fast_wake,
        )

    def validate(self, request: inference_service_pb2.GenerateRequest) -> None:
        super().validate(request)
        sampling_kwargs(request, self.tokenizer)

    def _prompt(self, text: str) -> Any:
        if self.tokenizer:
            return text
        return {"prompt_token_ids": prompt_token_ids(text, self.vocab_size)}

    async def agenerate(
        self, request: inference_service_pb2.GenerateRequest, sink: ChunkSink | None = None
    ) -> inference_service_pb2.GenerateResponse:
        """Run ``request`` through the async engine (batched with everything else in it)."""
        from vllm import SamplingParams

        params = SamplingParams(**sampling_kwargs(request, self.tokenizer))
        started = time.monotonic()
        request_id = f"grpc-{request.request_id or next(self._ids)}-{next(self._ids)}"
        self._running += 1
        batch = self._running
        final: Any = None
        sent_ids, sent_text = 0, 0
        try:
            async for output in self.engine.generate(self._prompt(request.prompt), params,
                                                     request_id):  # fmt: skip
                final = output
                batch = max(batch, self._running)
                completion = output.outputs[0]
                if sink is not None:
                    ids = [int(t) for t in completion.token_ids[sent_ids:]]
                    text = (completion.text or "")[sent_text:]
                    if ids or text:
                        sink(ids, text)
                    sent_ids, sent_text = len(completion.token_ids), len(completion.text or "")
        finally:
            self._running -= 1
        if final is None:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        response = response_of(request, final, batch)
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        raise RuntimeError("a vLLM stage serves through its async engine (agenerate)")
