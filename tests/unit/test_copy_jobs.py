"""Level-1 transitions issued from one thread: every device's pieces interleaved, in one call,
with the switch interval lowered while they run and restored after (issue 23's multi-GPU wake).

Two devices are simulated on the CPU as in test_engine_sharded.py; each call of
``torch._foreach_copy_`` (how the pieces are issued) is recorded with its thread, its pieces'
destinations and the switch interval at that moment.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from omnistage_worker.engine import copy_jobs, flat_weights, gil
from omnistage_worker.engine.components import ComponentEngine
from omnistage_worker.engine.copy_jobs import CopyJob, JobError, interleave, run_jobs
from omnistage_worker.engine.sharded import ShardedEngine
from omnistage_worker.engine.weights import WeightEngine
from tests.unit.test_engine_sharded import logits, sharded, tiny_llama

PIECE = 4096
ODD_INTERVAL = 0.0042
"""Set before each test: what a transition must restore (not the default, so a restore to a
constant would show)."""


class Issued:
    """The recorded calls of ``torch._foreach_copy_``."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def pieces(self) -> list[int]:
        """The destination address of every piece, in issue order."""
        return [ptr for call in self.calls for ptr in call["dsts"]]


@pytest.fixture
def issued(monkeypatch: pytest.MonkeyPatch) -> Iterator[Issued]:
    record = Issued()
    real = torch._foreach_copy_

    def recording(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **kw: Any) -> None:
        record.calls.append(
            {
                "thread": threading.get_ident(),
                "dsts": [d.data_ptr() for d in dsts],
                "interval": sys.getswitchinterval(),
            }
        )
        real(dsts, srcs, **kw)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    monkeypatch.setattr(flat_weights, "CHUNK_BYTES", PIECE)
    before = sys.getswitchinterval()
    sys.setswitchinterval(ODD_INTERVAL)
    try:
        yield record
    finally:
        sys.setswitchinterval(before)


def owner(ptr: int, buffers: list[torch.Tensor]) -> int:
    """Which buffer (device) holds the address ``ptr``."""
    for i, buffer in enumerate(buffers):
        if buffer.data_ptr() <= ptr < buffer.data_ptr() + buffer.numel():
            return i
    raise AssertionError(f"{ptr:#x} is in none of the buffers")


def expected_order(counts: list[int], lead: int) -> list[tuple[int, int]]:
    """(device, piece) in the order :func:`run_jobs` issues them."""
    heads = [(d, k) for d, n in enumerate(counts) for k in range(min(lead, n))]
    rests = [[(d, k) for k in range(lead, n)] for d, n in enumerate(counts)]
    longest = max((len(r) for r in rests), default=0)
    return heads + [r[k] for k in range(longest) for r in rests if k < len(r)]


def check_one_thread_interleaved(issued: Issued, buffers: list[torch.Tensor], lead: int) -> None:
    assert {c["thread"] for c in issued.calls} == {threading.get_ident()}
    assert all(c["interval"] == pytest.approx(gil.SWITCH_INTERVAL_S) for c in issued.calls)
    assert sys.getswitchinterval() == pytest.approx(ODD_INTERVAL)  # restored
    devices = [owner(ptr, buffers) for ptr in issued.pieces()]
    counts = [devices.count(d) for d in range(len(buffers))]
    assert all(n > 2 * lead for n in counts)  # enough pieces for the order to say something
    offsets = [
        (d, (ptr - buffers[d].data_ptr()) // PIECE)
        for d, ptr in zip(devices, issued.pieces(), strict=True)
    ]
    assert offsets == expected_order(counts, lead)
    assert len(issued.calls) == len(buffers) + 1  # each device's lead, then the rest in one


@pytest.mark.parametrize("lead", [1, 3])
def test_a_two_device_wake_and_sleep_issue_every_piece_from_one_thread_interleaved(
    issued: Issued, monkeypatch: pytest.MonkeyPatch, lead: int
) -> None:
    monkeypatch.setattr(copy_jobs, "LEAD_PIECES", lead)
    model = tiny_llama(tied=False)
    expected = logits(model)
    engine = sharded(model)
    engine.activate()
    flats = [s._flat for s in engine.shards]
    assert all(f is not None for f in flats)

    engine.sleep(1)
    hosts = [s._take_host().tensor for s in engine.shards]
    check_one_thread_interleaved(issued, hosts, lead)
    assert [s.level for s in engine.shards] == [1, 1] and engine.device_bytes() == 0
    assert len(engine.last) == 2 and all(s.seconds > 0 for s in engine.last)

    issued.calls.clear()
    engine.wake()
    woken = [s._flat for s in engine.shards]
    check_one_thread_interleaved(issued, [f for f in woken if f is not None], lead)
    assert [s.bytes_moved for s in engine.last] == [s.flat_bytes for s in engine.shards]
    assert torch.equal(logits(model), expected)
    engine.close()


def test_one_device_issues_its_pieces_in_two_calls_with_the_interval_lowered(
    issued: Issued,
) -> None:
    """The single-device engine takes the same path: its lead, then the rest."""
    model = tiny_llama(tied=False)
    expected = logits(model)
    engine = WeightEngine({"model": model}, torch.device("cpu"))
    engine.activate()
    engine.sleep(1)
    issued.calls.clear()
    stats = engine.wake()
    assert stats.bytes_moved == engine.flat_bytes and stats.seconds > 0
    flat = engine._flat
    assert flat is not None
    check_one_thread_interleaved(issued, [flat], copy_jobs.LEAD_PIECES)
    assert torch.equal(logits(model), expected)
    engine.close()


def check_largest_first_whole(issued: Issued, buffers: list[torch.Tensor]) -> None:
    """``buffers`` largest first: each one's pieces all issued, in order, in one call, before
    the next one's (one device: nothing to interleave with), from this thread, interval low."""
    assert {c["thread"] for c in issued.calls} == {threading.get_ident()}
    assert all(c["interval"] == pytest.approx(gil.SWITCH_INTERVAL_S) for c in issued.calls)
    devices = [owner(ptr, buffers) for ptr in issued.pieces()]
    counts = [devices.count(d) for d in range(len(buffers))]
    assert counts[0] > copy_jobs.LEAD_PIECES and counts[0] > counts[1] > 0
    assert devices == sorted(devices)  # the largest group's pieces, then the next one's
    offsets = [
        (ptr - buffers[d].data_ptr()) // PIECE
        for d, ptr in zip(devices, issued.pieces(), strict=True)
    ]
    assert offsets == [k for n in counts for k in range(n)]
    assert len(issued.calls) == len(buffers)  # each group's pieces in one call as it is made


def test_a_pipelines_groups_sleep_and_wake_in_one_issue_largest_first(issued: Issued) -> None:
    """A pipeline's component groups share one device: each group's pieces are issued whole as
    soon as its job is made, largest group first, so its copy runs while Python makes the
    others (the 2026-11-29 H200 logs: a 5-group diffusion stage, its largest group listed
    last, slept at 44-47 GB/s against 52 GB/s for one flat buffer)."""
    big, small = tiny_llama(tied=False), torch.nn.Linear(32, 48)
    expected, small_weight = logits(big), small.weight.detach().clone()
    engine = ComponentEngine({"small": small, "big": big}, torch.device("cpu"))  # small first
    engine.activate()
    engine.sleep(1)
    check_largest_first_whole(
        issued, [engine.engines[g]._take_host().tensor for g in ("big", "small")]
    )
    assert engine.device_bytes() == 0 and engine.level == 1
    issued.calls.clear()
    stats = engine.wake()
    assert stats.bytes_moved == sum(e.flat_bytes for e in engine.engines.values())
    flats = [engine.engines[g]._flat for g in ("big", "small")]
    check_largest_first_whole(issued, [f for f in flats if f is not None])
    assert torch.equal(logits(big), expected) and torch.equal(small.weight, small_weight)
    engine.close()


def test_a_failed_issue_aborts_every_job_and_restores_the_interval() -> None:
    before = sys.getswitchinterval()
    aborted: list[int] = []
    src = torch.arange(16, dtype=torch.uint8)

    def job(i: int) -> CopyJob:
        pieces = [(torch.empty(8, dtype=torch.uint8), src[:8])]
        return CopyJob(pieces, lambda: 8, lambda: aborted.append(i))

    def broken() -> CopyJob:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(JobError, match="job 2: CUDA out of memory") as failed:
        run_jobs([lambda: job(0), lambda: job(1), broken])
    assert failed.value.index == 2 and aborted == [0, 1]
    assert sys.getswitchinterval() == before
    stats = run_jobs([lambda: job(0), lambda: job(1)])
    assert [s.bytes_moved for s in stats] == [8, 8] and aborted == [0, 1]


@pytest.mark.parametrize(("at", "blamed"), [(0, 1), (copy_jobs.LEAD_PIECES, -1)])
def test_a_piece_that_fails_to_copy_names_its_job_or_the_interleaved_issue(
    at: int, blamed: int
) -> None:
    """A bad piece among a job's lead blames that job; after it, the issue of all of them."""
    aborted: list[int] = []
    good = (torch.empty(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8))
    bad = (torch.empty(4, dtype=torch.uint8), torch.zeros(5, dtype=torch.uint8))

    def job(i: int, pieces: list[tuple[torch.Tensor, torch.Tensor]]) -> CopyJob:
        return CopyJob(pieces, lambda: 4, lambda: aborted.append(i))

    second = [good] * (copy_jobs.LEAD_PIECES + 1)
    second[at] = bad
    with pytest.raises(JobError) as failed:
        run_jobs([lambda: job(0, [good]), lambda: job(1, second)])
    assert failed.value.index == blamed and aborted == [0, 1]


def test_an_interrupt_stays_an_interrupt_after_the_aborts() -> None:
    aborted: list[int] = []

    def interrupted() -> CopyJob:
        raise KeyboardInterrupt

    src = torch.zeros(4, dtype=torch.uint8)
    first = CopyJob(
        [(torch.empty(4, dtype=torch.uint8), src)], lambda: 4, lambda: aborted.append(0)
    )
    with pytest.raises(KeyboardInterrupt):
        run_jobs([lambda: first, interrupted])
    assert aborted == [0]


def test_interleave_deals_one_piece_of_each_queue_in_turn() -> None:
    a, b, c = (torch.empty(1) for _ in range(3))
    queues = [[(a, a), (a, b)], [(b, b)], [(c, c), (c, a), (c, b)]]
    order = interleave(queues)
    assert order == [(a, a), (b, b), (c, c), (a, b), (c, a), (c, b)]
    assert interleave([]) == [] and interleave([[], []]) == []


def test_the_sharded_engine_has_no_thread_per_device_left_for_level_1() -> None:
    """A level-1 cycle runs nothing on the per-device pool (level 2 still does)."""
    model = tiny_llama(tied=False)
    engine = sharded(model)
    engine.activate()
    submitted: list[object] = []
    real_submit = engine._pool.submit

    def submit(*args: Any, **kw: Any) -> Any:
        submitted.append(args[0])
        return real_submit(*args, **kw)

    engine._pool.submit = submit  # type: ignore[method-assign]
    engine.sleep(1)
    engine.wake()
    assert submitted == []
    engine.close()
    assert isinstance(engine, ShardedEngine)
