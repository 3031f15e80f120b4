"""vLLM runner: vLLM's own sleep mode, driven through its public Python API.

Thin by design: vLLM owns the weights, so the worker's weight engine is not used. vLLM is
imported only when this runner is chosen. Not tested in CI (no vLLM, no GPU there).

- level 1: ``llm.sleep(level=1)`` offloads weights to host memory and drops the KV cache;
  ``llm.wake_up()`` brings them back.
- level 2: ``llm.sleep(level=2)`` drops the weights too; the wake first maps the weight
  memory (``wake_up(tags=["weights"])``), reloads the weights from the model directory
  (``collective_rpc("reload_weights")``), then restores the KV cache
  (``wake_up(tags=["kv_cache"])``).
- 1 -> 2 while asleep is refused (FAILED_PRECONDITION): vLLM cannot drop its host copy
  without first taking the device memory back, which could overrun another stage.

Memory figures come from NVML for this process and its children (vLLM's engine core runs in a
child process), never from vLLM's return values. The residual baseline is this process's own
CUDA context; vLLM's engine core has a context of its own and keeps some memory while asleep
(CUDA graphs, NCCL), so give vLLM stages a larger ``--residual-slack`` (measure it once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import ModelRunner, SleepController

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 32


@dataclass(frozen=True)
class VllmStats:
    """Transfer figures of a vLLM transition (vLLM does not report bytes moved)."""

    bytes_moved: int
    seconds: float
    noop: bool


class VllmController:
    """Sleeps and wakes a ``vllm.LLM`` built with ``enable_sleep_mode=True``."""

    def __init__(self, llm: Any, weights_bytes: int) -> None:
        self._llm = llm
        self._level = 0
        self._weights_bytes = weights_bytes

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
        return VllmStats(0, time.monotonic() - started, False)

    def wake(self) -> VllmStats:
        if self._level == 0:
            return VllmStats(0, 0.0, True)
        started = time.monotonic()
        if self._level == 2:
            self._llm.wake_up(tags=["weights"])
            self._llm.collective_rpc("reload_weights")
            self._llm.wake_up(tags=["kv_cache"])
        else:
            self._llm.wake_up()
        self._level = 0
        return VllmStats(0, time.monotonic() - started, False)

    def device_bytes(self) -> int:
        return 0  # not used: vLLM runs on CUDA, where NVML measures

    def host_bytes(self) -> int:
        return self._weights_bytes if self._level == 1 else 0


class VllmRunner(ModelRunner):
    """A causal LM served by vLLM."""

    runner_kind = types_pb2.RUNNER_AR
    backend_kind = types_pb2.BACKEND_VLLM
    can_deepen = False

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.llm: Any = None

    def load(self) -> None:
        from vllm import LLM

        started = time.monotonic()
        kwargs: dict[str, Any] = {"model": str(self.model_dir), "enable_sleep_mode": True}
        if self.config.dtype != "auto":
            kwargs["dtype"] = self.config.dtype
        self.llm = LLM(**kwargs)
        log.info("vLLM loaded %s in %.2fs", self.model_dir, time.monotonic() - started)

    def build_controller(self) -> SleepController:
        weights = sum(p.stat().st_size for p in self.model_dir.glob("*.safetensors"))
        return VllmController(self.llm, weights)

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        from vllm import SamplingParams

        started = time.monotonic()
        params = SamplingParams(
            max_tokens=request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            temperature=1.0 if request.do_sample else 0.0,
            seed=request.seed if request.do_sample else None,
        )
        outputs = self.llm.generate([request.prompt], params, use_tqdm=False)
        completion = outputs[0].outputs[0]
        response = inference_service_pb2.GenerateResponse(
            request_id=request.request_id,
            text=inference_service_pb2.TextOutput(
                token_ids=[int(t) for t in completion.token_ids], text=completion.text
            ),
        )
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response
