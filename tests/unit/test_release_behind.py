"""A level-1 sleep gives its device buffer back piece by piece behind its copy (issue 23).

The driver cleans freed device memory in the background and host -> device copies run at half
rate meanwhile (bench/results/scrub_probe.json), so the sleeping stage frees each piece of its
flat buffer (:class:`omnistage_worker.engine.vmm.PieceBuffer`) as soon as the copy of it is done,
and the cleaning overlaps its own copy instead of the next stage's wake
(bench/results/release_behind_probe.json: 1.006 of the serial bound, against 1.09 freed whole).

On the CPU the engine runs over :class:`tests.unit.cpu_pieces.CpuPieces`, which behaves as
freed device memory does: a released piece's bytes are gone (overwritten), a piece is released
once, and a closed buffer holds nothing.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omnistage_worker.control.oom import is_out_of_memory, shortfall_in_message
from omnistage_worker.engine import WeightEngine, flat_weights, pinning
from omnistage_worker.engine.claims import ClaimGate
from omnistage_worker.engine.components import ComponentEngine
from omnistage_worker.engine.pinning import Mark, marked, pieces
from omnistage_worker.engine.vmm import piece_ends, piece_spans
from omnistage_worker.engine.vmm_driver import CudaError, OutOfMemoryError, out_of_memory_message
from tests.unit.cpu_pieces import CpuPieces
from tests.unit.test_engine_sharded import logits as logits_of
from tests.unit.test_engine_sharded import tiny_llama
from tests.unit.test_engine_weights import llama_dir, load, logits

__all__ = ["llama_dir"]


@pytest.fixture
def log(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    entries: list[str] = []
    real_wait = Mark.wait

    def logged_wait(mark: Mark) -> None:
        entries.append("wait")
        real_wait(mark)

    monkeypatch.setattr(Mark, "wait", logged_wait)
    monkeypatch.setattr(flat_weights, "CHUNK_BYTES", 1024)  # copies of 1 KiB: 4 per piece
    real_sync = WeightEngine._sync

    def logged_sync(engine: WeightEngine) -> None:
        entries.append("sync")
        real_sync(engine)

    monkeypatch.setattr(WeightEngine, "_sync", logged_sync)
    return entries


def test_marks_follow_the_piece_that_completes_each_end() -> None:
    src = torch.arange(10, dtype=torch.uint8)
    batch = pieces(torch.empty(10, dtype=torch.uint8), src, 0, 3)  # 3, 3, 3, 1 bytes
    steps, marks = marked(batch, [3, 5, 9, 10], torch.device("cpu"))
    kinds = [s[1].numel() if isinstance(s, tuple) else "mark" for s in steps]
    assert kinds == [3, "mark", 3, "mark", 3, "mark", 1, "mark"]
    assert len(marks) == 4
    with pytest.raises(ValueError, match="short of 11"):
        marked(batch, [11], torch.device("cpu"))


def test_spans_cover_the_buffer_in_granules() -> None:
    spans = piece_spans(10_000, 4096, 512)
    assert spans == [(0, 4096), (4096, 4096), (8192, 2048)]
    assert piece_spans(100, 4096, 512) == [(0, 512)]
    assert piece_spans(0, 4096, 512) == []


def test_a_sleep_releases_each_piece_after_its_copy_and_wakes_identical(
    llama_dir: Path, log: list[str]
) -> None:
    model = load(llama_dir)
    made: list[CpuPieces] = []

    def make(nbytes: int, device: torch.device, gate: ClaimGate | None) -> CpuPieces:
        made.append(CpuPieces(nbytes, device, log, gate))
        return made[-1]

    files = {"model": sorted(llama_dir.glob("*.safetensors"))}
    engine = WeightEngine({"model": model}, torch.device("cpu"), files, device_pieces=make)
    engine.activate()
    before = logits(model)
    assert len(made) == 1 and len(made[0].spans) > 4
    for cycle in range(2):
        log.clear()
        assert engine.sleep(1).bytes_moved == engine.flat_bytes
        asleep = made[-1]
        count = len(asleep.spans)
        # every piece waited for, then released, in order, before the job's last wait
        expected = [e for k in range(count) for e in ("wait", f"release {k}")]
        assert log[: 2 * count] == expected, log
        assert log[2 * count] == "sync"
        assert asleep.closed and not asleep.held
        engine.wake()
        assert len(made) == cycle + 2
        assert torch.equal(logits(model), before)


def test_a_pipelines_groups_release_behind_their_copies_before_any_finish(
    log: list[str],
) -> None:
    """Several groups' sleeps in one issue: every piece of every group goes back behind the
    copies, before the first group's finish waits for the device (on the H200 a 5-group
    diffusion stage's first finish waited for every group's copy, so its largest group
    released nothing early)."""
    first, second = tiny_llama(tied=False), tiny_llama(tied=False)
    expected = (logits_of(first), logits_of(second))
    made: list[CpuPieces] = []

    def make(nbytes: int, device: torch.device, gate: ClaimGate | None) -> CpuPieces:
        made.append(CpuPieces(nbytes, device, log, gate))
        return made[-1]

    engine = ComponentEngine(
        {"text": first, "decoder": second}, torch.device("cpu"), device_pieces=make
    )
    engine.activate()
    log.clear()
    engine.sleep(1)
    releases = sum(len(m.spans) for m in made)
    assert log.index("sync") == 2 * releases, log
    assert log[: 2 * releases].count("wait") == releases
    assert all(m.closed and not m.held for m in made)
    engine.wake()
    assert torch.equal(logits_of(first), expected[0])
    assert torch.equal(logits_of(second), expected[1])


def test_without_pieces_the_buffer_is_one_allocation(llama_dir: Path, log: list[str]) -> None:
    model = load(llama_dir)
    files = {"model": sorted(llama_dir.glob("*.safetensors"))}
    engine = WeightEngine({"model": model}, torch.device("cpu"), files)
    engine.activate()
    before = logits(model)
    engine.sleep(1)
    assert "wait" not in log
    engine.wake()
    assert torch.equal(logits(model), before)


def test_piece_ends_cut_the_last_piece_padding() -> None:
    class Spans:
        spans = [(0, 4096), (4096, 4096), (8192, 2048)]

        def tensor(self) -> torch.Tensor:
            raise AssertionError

        def release(self, k: int) -> None:
            raise AssertionError

        def close(self) -> None:
            raise AssertionError

    assert piece_ends(Spans(), 10_000) == [4096, 8192, 10_000]


def test_copy_pieces_records_each_mark_between_its_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[object] = []
    real = torch._foreach_copy_

    def recording(dsts: list[torch.Tensor], srcs: list[torch.Tensor], **kw: object) -> None:
        calls.append(len(dsts))
        real(dsts, srcs, non_blocking=True)

    monkeypatch.setattr(torch, "_foreach_copy_", recording)
    monkeypatch.setattr(Mark, "record", lambda mark: calls.append("mark"))
    src = torch.arange(10, dtype=torch.uint8)
    dst = torch.zeros(10, dtype=torch.uint8)
    steps, _ = marked(pieces(dst, src, 0, 2), [4, 10], torch.device("cpu"))
    pinning.copy_pieces(steps)
    assert calls == [2, "mark", 3, "mark"]
    assert torch.equal(dst, src)


def test_a_buffer_without_room_reads_as_an_oom_with_its_shortfall() -> None:
    """The worker tells a real OOM from other failures by its words (control/oom.py): a piece
    the driver refuses for want of memory (CUDA error 2) says so as PyTorch would."""
    error = OutOfMemoryError(out_of_memory_message(0, 17 << 30, 5 << 30, 80 << 30))
    assert is_out_of_memory(error)
    assert shortfall_in_message(str(error)) == 12 << 30
    assert not is_out_of_memory(CudaError("cuMemMap", 1))
