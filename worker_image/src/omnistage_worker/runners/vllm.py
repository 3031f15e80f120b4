"""vLLM runner: vLLM's own sleep mode, driven through its public Python API (vLLM 0.24).

vLLM owns the weights, so the worker's weight engine is not used; vLLM is imported only when
this runner is chosen. CI runs it against the stand-in engine in ``tests/fakevllm`` (same call
surface, real memory physics on the simulated GPU); ``bench/vllm_stage.py`` runs real vLLM.

- The worker process takes no CUDA context of its own (``owns_device_context = False``): vLLM's
  engine core runs in a child process, and the probe measures that process tree with NVML
  (recognising host pids where the driver reports them: ``EngineTreeProbe.adopt_engine``).
- ``gpu_memory_utilization`` comes from ``--vllm-*`` (``config.VllmArgs.utilization``): given,
  or the stage's memory over the device's total, or the free memory at start.
- The residual bound is derived from what the engine holds asleep, measured once at start:
  one level-1 sleep and wake right after loading (context, CUDA graphs, NCCL buffers stay).
- level 1: ``llm.sleep(level=1)`` offloads weights to host memory and drops the KV cache;
  ``llm.wake_up()`` brings them back.
- level 2: ``llm.sleep(level=2)`` drops the weights too; the wake maps the weight memory
  (``wake_up(tags=["weights"])``), reloads the weights from the model directory
  (``collective_rpc("reload_weights")``), then maps the KV cache (``wake_up(tags=["kv_cache"])``).
- 1 -> 2 while asleep is refused (``can_deepen = False``): vLLM cannot drop its host copy
  without first taking the device memory back, which could overrun another stage.
- A wake that fails (e.g. out of memory) puts the engine back to sleep at its level.
- Prompts: text when the model directory has a tokenizer; otherwise vLLM starts with
  ``skip_tokenizer_init`` and a prompt's UTF-8 bytes are its token ids (the response carries
  token ids only).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import EngineTreeProbe, MemoryProbe
from omnistage_worker.runners.base import InvalidRequest, ModelRunner, SleepController

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 32
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


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
    """Sleeps and wakes a ``vllm.LLM`` built with ``enable_sleep_mode=True``.

    ``flat_bytes``: what a wake takes on the device (weights and KV cache), measured at start;
    an accounted device refuses a wake ahead of time when it does not fit.
    """

    def __init__(self, llm: Any, weights_bytes: int, wake_bytes: int = 0) -> None:
        self._llm = llm
        self._level = 0
        self._weights_bytes = weights_bytes
        self.flat_bytes = wake_bytes or weights_bytes

    @property
    def level(self) -> int:
        return self._level

    @property
    def weights_bytes(self) -> int:
        return self._weights_bytes

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
        self._llm.sleep(level=level)
        self._level = level
        moved = self._weights_bytes if level == 1 else 0
        return VllmStats(moved, time.monotonic() - started, False)

    def wake(self) -> VllmStats:
        if self._level == 0:
            return VllmStats(0, 0.0, True)
        started = time.monotonic()
        try:
            if self._level == 2:
                self._llm.wake_up(tags=["weights"])
                self._llm.collective_rpc("reload_weights")
                self._llm.wake_up(tags=["kv_cache"])
            else:
                self._llm.wake_up()
        except Exception:
            # Part of the memory may be mapped again: give it back before reporting.
            log.warning("vLLM wake from level %d failed; back to sleep", self._level)
            with contextlib.suppress(Exception):
                self._llm.sleep(level=self._level)
            raise
        self._level = 0
        return VllmStats(self._weights_bytes, time.monotonic() - started, False)

    def device_bytes(self) -> int:
        return 0  # the engine's memory is measured on the device, never accounted here

    def host_bytes(self) -> int:
        return self._weights_bytes if self._level == 1 else 0


class VllmRunner(ModelRunner):
    """A causal LM served by vLLM."""

    runner_kind = types_pb2.RUNNER_AR
    backend_kind = types_pb2.BACKEND_VLLM
    can_deepen = False
    owns_device_context = False

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.llm: Any = None
        self.vocab_size = 0
        self.tokenizer = has_tokenizer(config.model)
        self._baseline: int | None = None
        self._wake_bytes = 0

    def _probe(self) -> MemoryProbe:
        if self.probe is None:
            raise RuntimeError("the vLLM runner measures with the worker's probe: none is set")
        return self.probe

    def engine_kwargs(self, total: int, free: int) -> dict[str, Any]:
        """``vllm.LLM``'s arguments for a device of ``total`` bytes with ``free`` now."""
        engine = self.config.vllm
        kwargs: dict[str, Any] = {
            "model": str(self.model_dir),
            "enable_sleep_mode": True,
            "gpu_memory_utilization": engine.utilization(total, free),
            "tensor_parallel_size": engine.tensor_parallel_size,
            "enforce_eager": engine.enforce_eager,
            "skip_tokenizer_init": not self.tokenizer,
            "seed": 0,
        }
        if engine.max_model_len is not None:
            kwargs["max_model_len"] = engine.max_model_len
        if self.config.dtype != "auto":
            kwargs["dtype"] = self.config.dtype
        if engine.attention_backend is not None:
            kwargs["attention_backend"] = engine.attention_backend
        return kwargs

    def load(self) -> None:
        # vLLM forks its engine core by default; this process runs gRPC threads, which must
        # not be forked: spawn it (the worker's entry points are import-safe).
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        from vllm import LLM

        probe = self._probe()
        device = min(probe.read().devices, key=lambda d: d.free)
        tree = probe if isinstance(probe, EngineTreeProbe) else None
        listed = tree.listed_pids() if tree is not None else set()
        kwargs = self.engine_kwargs(device.total, device.free)
        started = time.monotonic()
        log.info("starting vLLM: %s", kwargs)
        self.llm = LLM(**kwargs)
        if tree is not None:
            tree.adopt_engine(listed)
        self.vocab_size = vocab_size(self.model_dir)
        log.info("vLLM loaded %s in %.2fs", self.model_dir, time.monotonic() - started)
        self._calibrate(probe)

    def _calibrate(self, probe: MemoryProbe) -> None:
        """Measure once what the engine holds asleep (context, CUDA graphs, NCCL): a level-1
        sleep and wake before the worker serves (the pod was admitted with this memory)."""
        active = probe.read().used
        started = time.monotonic()
        self.llm.sleep(level=1)
        asleep = probe.read().used
        self.llm.wake_up()
        self._baseline = asleep
        self._wake_bytes = max(0, active - asleep)
        log.info(
            "vLLM holds %d bytes active, %d asleep (the residual baseline); calibrated in %.2fs",
            active,
            asleep,
            time.monotonic() - started,
        )

    def residual_baseline(self) -> int | None:
        return self._baseline

    def build_controller(self) -> SleepController:
        weights = sum(p.stat().st_size for p in self.model_dir.glob("*.safetensors"))
        return VllmController(self.llm, weights, self._wake_bytes)

    def validate(self, request: inference_service_pb2.GenerateRequest) -> None:
        """Refuse what ``LLM.generate`` is not given here (until the stage serves through
        vLLM's own server): stop strings, a sampling temperature or top_p, log probabilities."""
        super().validate(request)
        if request.stop:
            raise InvalidRequest("stop", "not supported by this vLLM stage")
        if request.HasField("temperature") and request.temperature != 0:
            raise InvalidRequest("temperature", "only 0 (greedy) on this vLLM stage")
        for name in ("top_p", "top_logprobs"):
            if request.HasField(name):
                raise InvalidRequest(name, "not supported by this vLLM stage")

    def _prompt(self, text: str) -> Any:
        if self.tokenizer:
            return text
        return {"prompt_token_ids": prompt_token_ids(text, self.vocab_size)}

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        from vllm import SamplingParams

        started = time.monotonic()
        params = SamplingParams(
            max_tokens=request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            temperature=1.0 if request.do_sample else 0.0,
            seed=request.seed if request.do_sample else None,
            detokenize=self.tokenizer,
        )
        outputs = self.llm.generate([self._prompt(request.prompt)], params, use_tqdm=False)
        completion = outputs[0].outputs[0]
        reason = {
            "stop": inference_service_pb2.FINISH_REASON_STOP,
            "length": inference_service_pb2.FINISH_REASON_LENGTH,
        }.get(
            getattr(completion, "finish_reason", None) or "",
            inference_service_pb2.FINISH_REASON_UNSPECIFIED,
        )
        response = inference_service_pb2.GenerateResponse(
            request_id=request.request_id,
            text=inference_service_pb2.TextOutput(
                token_ids=[int(t) for t in completion.token_ids],
                text=completion.text or "",
                finish_reason=reason,
            ),
            usage=inference_service_pb2.Usage(
                prompt_tokens=len(outputs[0].prompt_token_ids or ()),
                completion_tokens=len(completion.token_ids),
            ),
            batch_size=1,
        )
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response
