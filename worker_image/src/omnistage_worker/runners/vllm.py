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
from pathlib import Path
from typing import Any

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import EngineTreeProbe, MemoryProbe
from omnistage_worker.runners.base import ChunkSink, ModelRunner, SleepController
from omnistage_worker.runners.vllm_controller import (
    ENGINE_CALL_TIMEOUT_S,
    Started,
    VllmController,
    end_lifespan,
)
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
        self.vocab_size = vocab_size(self.model_dir)
        if self.config.initial_state == "asleep":
            self._prewarm()
        else:
            self._start_engine()

    def _prewarm(self) -> None:
        """Import vLLM and check the flags without starting the engine: the stage holds no
        device memory (nor host copy: level 2), and its first wake starts the engine with
        the imports done (here, and in the engine core's fork server)."""
        started = time.monotonic()
        device = min(self._probe().read().devices, key=lambda d: d.total)
        parse_serve_args(self.serve_argv(device.total, device.total))
        self.fields = request_fields()
        log.info(
            "vLLM imported in %.2fs; its engine starts at the first wake (pre-warmed: no "
            "device memory held until then)",
            time.monotonic() - started,
        )

    def _start_engine(self) -> Started:
        """Start vLLM's engine and its app, then calibrate; a failure stops what started."""
        probe = self._probe()
        device = min(probe.read().devices, key=lambda d: d.free)
        tree = probe if isinstance(probe, EngineTreeProbe) else None
        listed = tree.listed_pids() if tree is not None else set()
        argv = self.serve_argv(device.total, device.free)
        started = time.monotonic()
        log.info("starting vLLM's engine: vllm serve %s", " ".join(argv))
        self.serve_args = parse_serve_args(argv)
        self.engine = start_engine(self.serve_args)
        try:
            if tree is not None:
                tree.adopt_engine(listed)
            self.fields = request_fields()
            self.app, self._lifespan = self.bridge.call(
                build_openai_app(self.engine, self.serve_args)
            )
            log.info("vLLM loaded %s in %.2fs", self.model_dir, time.monotonic() - started)
            self._calibrate(probe)
        except BaseException:
            self._stop_engine()
            raise
        return Started(self.engine, self._lifespan, self._wake_bytes)

    def _stop_engine(self) -> None:
        """After a failed start: the app's lifespan ended, the engine core stopped."""
        engine, lifespan = self.engine, self._lifespan
        self.engine = self.app = self._lifespan = None
        end_lifespan(self.bridge, lifespan)
        with contextlib.suppress(Exception):
            engine.shutdown()

    def _planned_bytes(self) -> int:
        """What a pre-warmed engine will take per the flags (0: the free memory decides)."""
        args = self.config.vllm
        if args.memory_bytes is not None:
            return args.memory_bytes
        if args.gpu_memory_utilization is not None:
            total = sum(d.total for d in self._probe().read().devices)
            return int(args.gpu_memory_utilization * total)
        return 0

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
            self._wake_bytes if self.engine is not None else self._planned_bytes(),
            lifespan=self._lifespan,
            keeps_host_copy=self.config.vllm.fast_wake,
            start=self._start_engine,
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
