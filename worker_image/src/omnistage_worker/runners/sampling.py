"""How a request chooses its tokens: greedy, or seeded sampling with its own
temperature/top-k/top-p, and the log probabilities it asks for (validated and resolved
against the model's generation config). :mod:`.token_choice` applies it to a batch."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest

MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20

# transformers' own defaults for sampling knobs a model's generation config leaves unset.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_TOP_K = 50
DEFAULT_TOP_P = 1.0


@dataclass(frozen=True)
class Sampling:
    """How one request chooses its tokens."""

    greedy: bool
    temperature: float = DEFAULT_TEMPERATURE
    top_k: int = 0
    """0: no top-k cut."""
    top_p: float = DEFAULT_TOP_P
    seed: int = 0
    top_logprobs: int | None = None
    """None: no log probabilities; 0..20: the token's own and this many alternatives."""


def validate_sampling(request: inference_service_pb2.GenerateRequest) -> None:
    """Refuse sampling fields out of range with :class:`InvalidRequest` naming the field."""
    if request.HasField("temperature") and not request.temperature >= 0:
        raise InvalidRequest("temperature", f"{request.temperature} must be >= 0")
    if request.HasField("top_p") and not 0 < request.top_p <= 1:
        raise InvalidRequest("top_p", f"{request.top_p} must be in (0, 1]")
    if request.HasField("top_logprobs") and not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest("top_logprobs", f"{request.top_logprobs} must be 0 to 20")
    if len(request.stop) > MAX_STOPS:
        raise InvalidRequest("stop", f"{len(request.stop)} stop sequences (at most {MAX_STOPS})")
    for index, stop in enumerate(request.stop):
        if not stop:
            raise InvalidRequest(f"stop[{index}]", "must not be empty")


def resolve_sampling(request: inference_service_pb2.GenerateRequest, defaults: Any) -> Sampling:
    """The request's sampling, with the model's generation config (``defaults``) filling what
    the request leaves unset: temperature unset keeps ``do_sample``; 0 is greedy."""
    top_logprobs = request.top_logprobs if request.HasField("top_logprobs") else None
    if request.HasField("temperature"):
        greedy = request.temperature == 0
        temperature = request.temperature if not greedy else DEFAULT_TEMPERATURE
    else:
        greedy = not request.do_sample
        temperature = _number(getattr(defaults, "temperature", None), DEFAULT_TEMPERATURE)
    if greedy:
        return Sampling(greedy=True, top_logprobs=top_logprobs)
    top_p = (
        request.top_p
        if request.HasField("top_p")
        else _number(getattr(defaults, "top_p", None), DEFAULT_TOP_P)
    )
    top_k = int(_number(getattr(defaults, "top_k", None), DEFAULT_TOP_K))
    return Sampling(
        greedy=False,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=request.seed,
        top_logprobs=top_logprobs,
    )


def _number(value: Any, default: float) -> float:
    return float(value) if isinstance(value, int | float) and not math.isnan(value) else default
