"""The decode batcher's CUDA-graph steps (runners/step_graphs.py): when a cache's plain step is
captured, and that a replay feeds the step's own inputs to the captured buffers. The graphs
themselves run only on a GPU: bench/decode_graphs.py measures them there (identical tokens,
speed, nothing left on the device)."""

from __future__ import annotations

from typing import Any

import torch

from omnistage_worker.runners.kv_buckets import BucketCache
from omnistage_worker.runners.step_graphs import (
    MIN_ROOM,
    StepGraph,
    StepGraphs,
    worth_capturing,
)


def test_a_cache_is_captured_on_its_second_plain_step_with_room_left() -> None:
    assert not worth_capturing(0, 64)  # its first plain step runs eagerly
    assert worth_capturing(1, 64)
    assert worth_capturing(1, MIN_ROOM)
    assert not worth_capturing(5, MIN_ROOM - 1)  # about to be laid out anew: not worth it


class Forward:
    """A step's 'model': logits that depend on every input, so a stale buffer shows."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        self.calls += 1
        seen = mask.reshape(mask.shape[0], -1).sum(dim=1, keepdim=True).float()
        return (ids * 100 + positions).float() + seen


class Replayed:
    """Stands in for a captured CUDA graph on the CPU: a replay recomputes from the static
    buffers into the static output, as the real graph's kernels do."""

    def __init__(self, forward: Forward, graph: StepGraph | None = None) -> None:
        self.forward, self.graph = forward, graph

    def replay(self) -> None:
        assert self.graph is not None
        g = self.graph
        g.logits.copy_(self.forward(g.ids, g.positions, g.mask, None))


def test_on_a_cpu_every_step_runs_eagerly_and_no_graph_is_kept() -> None:
    forward = Forward()
    graphs = StepGraphs(forward, torch.device("cpu"), enabled=True)
    cache = BucketCache(2, 64, torch.device("cpu"), additive=False)
    assert not graphs.enabled
    for step in range(3):
        cache.plain_steps = step
        graphs.step(cache, torch.ones(2, 1, dtype=torch.long), torch.zeros(2, 1), torch.ones(2, 1))
    assert forward.calls == 3 and cache.graph is None and graphs.captures == 0


def test_a_replay_feeds_the_steps_own_inputs_to_the_captured_buffers() -> None:
    forward = Forward()
    graphs = StepGraphs(forward, torch.device("cpu"), enabled=False)
    cache = BucketCache(2, 64, torch.device("cpu"), additive=False)
    first = (torch.tensor([[1], [2]]), torch.tensor([[5], [6]]), torch.ones(2, 1, 1, 64).bool())
    stand_in = Replayed(forward)
    ids, positions, mask = (t.clone() for t in first)
    cache.graph = StepGraph(stand_in, ids, positions, mask, forward(*first, None))
    stand_in.graph = cache.graph
    later = (torch.tensor([[7], [8]]), torch.tensor([[9], [3]]), torch.zeros(2, 1, 1, 64).bool())
    got = graphs.step(cache, *later)
    assert torch.equal(got, forward(*later, None))
    assert graphs.replays == 1


def test_a_new_layout_keeps_room_for_what_its_rows_still_want_up_to_a_bound() -> None:
    from omnistage_worker.runners.decode_policy import GRAPH_SPARE, spare_columns

    assert spare_columns([]) == 0
    assert spare_columns([3, 10]) == 10
    assert spare_columns([0, -1]) == 0
    assert spare_columns([10_000]) == GRAPH_SPARE
