"""STAND-IN for vLLM 0.24's ``LLM`` and ``SamplingParams`` (CI only; see ``tests/fakevllm``).

Same call surface as the real ones for what the worker uses; anything else raises TypeError
(an unknown engine argument) or NotImplementedError. The engine runs in a child process
(:mod:`.engine_core`) with real physics on the simulated GPU named by ``OMNISTAGE_FAKE_GPU``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__version__ = "0.24.0+standin"
STAND_IN = True

_ENGINE_ARGS = frozenset(
    {
        "enable_sleep_mode",
        "gpu_memory_utilization",
        "tensor_parallel_size",
        "enforce_eager",
        "skip_tokenizer_init",
        "seed",
        "max_model_len",
        "dtype",
        "attention_backend",
    }
)


class EngineError(RuntimeError):
    """An error the engine core raised (its type name and message)."""


@dataclass
class SamplingParams:
    """The sampling fields the worker sets (greedy only in the stand-in)."""

    max_tokens: int = 16
    temperature: float = 1.0
    seed: int | None = None
    detokenize: bool = True


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)


class LLM:
    """``vllm.LLM`` with sleep mode, on the simulated GPU."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - _ENGINE_ARGS
        if unknown:
            raise TypeError(f"EngineArgs.__init__() got unexpected arguments {sorted(unknown)}")
        if int(kwargs.get("tensor_parallel_size", 1)) != 1:
            raise NotImplementedError("the stand-in engine runs on one simulated device")
        self.model = Path(model)
        self.sleep_mode = bool(kwargs.get("enable_sleep_mode", False))
        self.skip_tokenizer_init = bool(kwargs.get("skip_tokenizer_init", False))
        if not self.skip_tokenizer_init:
            raise NotImplementedError("the stand-in has no tokenizer: use skip_tokenizer_init")
        self.max_model_len = kwargs.get("max_model_len")
        self._lock = threading.Lock()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.engine_core"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        init = {
            "model": model,
            "gpu_memory_utilization": float(kwargs.get("gpu_memory_utilization", 0.9)),
            "enforce_eager": bool(kwargs.get("enforce_eager", False)),
        }
        try:
            self.engine = self._call(init)
        except EngineError:
            self._proc.wait(10)
            raise

    def _call(self, request: dict[str, Any]) -> Any:
        with self._lock:
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._proc.stdin.write(json.dumps(request) + "\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise EngineError(f"engine core died (exit {self._proc.poll()})")
        answer = json.loads(line)
        if not answer["ok"]:
            raise EngineError(f"{answer['type']}: {answer['error']}")
        return answer["result"]

    @property
    def engine_pid(self) -> int:
        return int(self._proc.pid)

    def sleep(self, level: int = 1) -> None:
        if not self.sleep_mode:
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=True)")
        self._call({"op": "sleep", "level": level})

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._call({"op": "wake_up", "tags": tags})

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if method != "reload_weights" or args:
            raise NotImplementedError("the stand-in knows collective_rpc('reload_weights') only")
        return [self._call({"op": "reload_weights"})]

    def generate(
        self,
        prompts: list[Any],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        ids: list[list[int]] = []
        for prompt in prompts:
            if not isinstance(prompt, dict) or "prompt_token_ids" not in prompt:
                raise ValueError("the stand-in takes {'prompt_token_ids': [...]} prompts only")
            tokens = [int(t) for t in prompt["prompt_token_ids"]]
            if self.max_model_len is not None and len(tokens) + params.max_tokens > int(
                self.max_model_len
            ):
                raise ValueError(
                    f"prompt ({len(tokens)} tokens) plus max_tokens ({params.max_tokens}) is "
                    f"longer than max_model_len ({self.max_model_len})"
                )
            ids.append(tokens)
        outs = self._call({"op": "generate", "prompts": ids, "max_tokens": params.max_tokens})
        return [
            RequestOutput(str(i), prompt, [CompletionOutput(0, "", list(out))])
            for i, (prompt, out) in enumerate(zip(ids, outs, strict=True))
        ]

    def shutdown(self) -> None:
        """Stop the engine core (its memory goes with it)."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            self._proc.stdin.close()
            self._proc.wait(10)

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
