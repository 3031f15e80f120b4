"""A decode step's token choice over all rows at once, and what the host reads back of it.

Every row keeps its own sampling (greedy, or temperature/top-k/top-p), yet the work is a fixed
number of tensor operations whatever the rows: warping is batched with per-row parameters,
and a sampled row draws by inverse CDF with one uniform number from its own request's
generator (a ``random.Random`` seeded by the request), so what it draws never depends on the
other rows of the batch. The host reads a step's result in one copy (:func:`read_step`): the
tokens, and for rows that asked, their log probabilities.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.sampling import Sampling

TokenLogprob = inference_service_pb2.TokenLogprob


def to_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (on the host) on ``device`` without waiting: through page-locked memory, so
    the copy is queued behind the work already queued instead of stopping the host."""
    if device.type != "cuda":
        return values.to(device)
    return values.pin_memory().to(device, non_blocking=True)


def new_generator(seed: int) -> random.Random:
    """A request's own source of draws (one uniform number per sampled token)."""
    return random.Random(seed)


def warp_rows(logits: torch.Tensor, samplings: Sequence[Sampling]) -> torch.Tensor:
    """Rows of float logits scaled and cut as transformers' warpers do, each row with its own
    temperature, then top-k, then top-p (the most likely token always survives)."""
    vocab = logits.shape[-1]
    device = logits.device
    scores = logits
    temperatures = [s.temperature for s in samplings]
    if any(t != 1.0 for t in temperatures):
        scores = scores / to_device(torch.tensor(temperatures, dtype=scores.dtype), device)[:, None]
    ks = [s.top_k if 0 < s.top_k < vocab else 0 for s in samplings]
    if any(ks):
        best = torch.topk(scores, max(ks), dim=-1).values
        at = to_device(torch.tensor([max(k - 1, 0) for k in ks]), device)
        kth = best.gather(1, at[:, None])
        uncut = to_device(torch.tensor([k == 0 for k in ks]), device)
        kth = kth.masked_fill(uncut[:, None], -math.inf)
        scores = scores.masked_fill(scores < kth, -math.inf)
    ps = [s.top_p for s in samplings]
    if any(p < 1.0 for p in ps):
        ordered, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
        limits = to_device(torch.tensor([1 - p for p in ps], dtype=cumulative.dtype), device)
        drop_sorted = cumulative <= limits[:, None]
        drop_sorted &= to_device(torch.tensor([p < 1.0 for p in ps]), device)[:, None]
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, -math.inf)
    return scores


def choose(
    logits: torch.Tensor,
    samplings: Sequence[Sampling],
    generators: Sequence[random.Random | None],
) -> torch.Tensor:
    """The next token of each row of ``logits`` (``[rows, vocab]``, float), on its device:
    argmax for greedy rows, an inverse-CDF draw for sampled ones (their generator's next
    uniform number), with no wait for the device."""
    tokens = logits.argmax(dim=-1)
    sampled = [row for row, s in enumerate(samplings) if not s.greedy]
    if not sampled:
        return tokens
    device = logits.device
    index = to_device(torch.tensor(sampled), device)
    probs = warp_rows(logits.index_select(0, index), [samplings[r] for r in sampled]).softmax(-1)
    cdf = probs.cumsum(dim=-1)
    draws: list[float] = []
    for row in sampled:
        generator = generators[row]
        assert generator is not None, "a sampled row needs its generator"
        draws.append(1.0 - generator.random())  # in (0, 1]: never a token of probability 0
    uniform = to_device(torch.tensor(draws, dtype=cdf.dtype), device)
    picked = torch.searchsorted(cdf, uniform[:, None] * cdf[:, -1:])[:, 0]
    return tokens.index_copy(0, index, picked.clamp(max=cdf.shape[-1] - 1))


def read_step(
    tokens: torch.Tensor,
    logits: torch.Tensor,
    tops: Sequence[int | None],
    decode: Callable[[int], str],
) -> list[tuple[int, TokenLogprob | None]]:
    """Per row: its token and, where ``tops[row]`` is not None, the token's log probability
    under the raw distribution (log_softmax of the logits, before any warping) with the
    ``tops[row]`` most likely tokens. One copy from the device for the whole step."""
    wanted = [top for top in tops if top is not None]
    if not wanted:
        return [(int(t), None) for t in tokens.tolist()]
    logprobs = torch.log_softmax(logits, dim=-1)
    parts = [tokens[:, None].double(), logprobs.gather(1, tokens[:, None]).double()]
    most = max(wanted)
    if most:
        best = torch.topk(logprobs, most, dim=-1)
        parts += [best.values.double(), best.indices.double()]
    table = torch.cat(parts, dim=1).tolist()
    out: list[tuple[int, TokenLogprob | None]] = []
    for values, top in zip(table, tops, strict=True):
        token = int(values[0])
        if top is None:
            out.append((token, None))
            continue
        entry = TokenLogprob(token_id=token, token=decode(token), logprob=values[1])
        for i in range(top):
            other = int(values[2 + most + i])
            entry.top.add(token_id=other, token=decode(other), logprob=values[2 + i])
        out.append((token, entry))
    return out
