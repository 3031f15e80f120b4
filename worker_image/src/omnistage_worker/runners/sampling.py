"""Per-request token choice for a batch of logits: greedy, or seeded sampling with the
request's own temperature/top-k/top-p, and the raw log probabilities a request asks for.

Each sampled request draws from its own ``torch.Generator`` (seeded by its ``seed``), one row
at a time, so what it draws never depends on the other rows of the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

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


def warp(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One row of float logits scaled and cut as transformers' warpers do (temperature,
    then top-k, then top-p; the most likely token always survives)."""
    scores = logits / sampling.temperature if sampling.temperature != 1.0 else logits
    if 0 < sampling.top_k < scores.shape[-1]:
        kth = torch.topk(scores, sampling.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if sampling.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - sampling.top_p)
        drop_sorted[-1] = False
        drop = drop_sorted.scatter(0, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores


def choose(
    logits: torch.Tensor,
    samplings: list[Sampling],
    generators: list[torch.Generator | None],
) -> list[int]:
    """The next token of each row of ``logits`` (``[rows, vocab]``, float)."""
    tokens = logits.argmax(dim=-1)
    for row, (sampling, generator) in enumerate(zip(samplings, generators, strict=True)):
        if sampling.greedy:
            continue
        probs = warp(logits[row], sampling).softmax(dim=-1)
        tokens[row] = torch.multinomial(probs, 1, generator=generator)[0]
    return [int(t) for t in tokens.tolist()]


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    """A generator on ``device`` seeded for one request."""
    return torch.Generator(device=device).manual_seed(seed)


def token_logprobs(
    logits: torch.Tensor, tokens: list[int], tops: list[int | None], decode: Any
) -> list[inference_service_pb2.TokenLogprob | None]:
    """Per row: the chosen token's log probability under the raw distribution (log_softmax
    of the logits, before any warping) and the ``tops[row]`` most likely tokens (None: the
    row asked for none). ``decode`` turns one token id into its text."""
    wanted = [row for row, top in enumerate(tops) if top is not None]
    out: list[inference_service_pb2.TokenLogprob | None] = [None] * len(tokens)
    if not wanted:
        return out
    index = torch.tensor(wanted, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index), dim=-1)
    most = max(int(tops[row] or 0) for row in wanted)
    best = torch.topk(logprobs, most, dim=-1) if most else None
    chosen_ids = torch.tensor([tokens[row] for row in wanted], device=logits.device)
    chosen = logprobs.gather(1, chosen_ids[:, None])[:, 0].tolist()
    best_values = best.values.tolist() if best is not None else [[] for _ in wanted]
    best_ids = best.indices.tolist() if best is not None else [[] for _ in wanted]
    for at, row in enumerate(wanted):
        count = int(tops[row] or 0)
        entry = inference_service_pb2.TokenLogprob(
            token_id=tokens[row], token=decode(tokens[row]), logprob=chosen[at]
        )
        for token_id, value in zip(best_ids[at][:count], best_values[at][:count], strict=True):
            entry.top.add(token_id=token_id, token=decode(token_id), logprob=value)
        out[row] = entry
    return out
