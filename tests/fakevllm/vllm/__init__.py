"""STAND-IN for vLLM 0.24 (CI only; see ``tests/fakevllm``): the part the worker uses.

Modules mirror vLLM's: ``vllm.engine.arg_utils.AsyncEngineArgs``,
``vllm.v1.engine.async_llm.AsyncLLM`` (its engine core is a child process with real physics on
the simulated GPU named by ``OMNISTAGE_FAKE_GPU``: :mod:`.engine_core`),
``vllm.entrypoints.openai.cli_args`` (``make_arg_parser``, ``validate_parsed_serve_args``) and
``vllm.entrypoints.openai.api_server`` (``build_app``, ``init_app_state``: the OpenAI routes the
stand-in serves, in vLLM's shapes). Anything else raises (an unknown flag is an argparse
error, an unsupported request field a 400 that says the stand-in lacks it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

__version__ = "0.24.0+standin"
STAND_IN = True


class RequestOutputKind(Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass
class SamplingParams:
    """vLLM's sampling parameters (those the stand-in honours; others are refused)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    logprobs: int | None = None
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        if self.logprobs is not None:
            raise NotImplementedError("the stand-in engine computes no logprobs")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: Any = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: Any = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = 0
