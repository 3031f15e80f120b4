"""Pure layout logic of the sleep engine: aligned slots and chunked copy runs."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from omnistage_worker.engine.layout import ALIGNMENT, CopyRun, SlotSpec, plan_layout, split_runs


@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=40))
def test_slots_are_aligned_disjoint_and_fit(sizes: list[int]) -> None:
    layout = plan_layout(SlotSpec(i, n) for i, n in enumerate(sizes))
    assert layout.total_bytes % ALIGNMENT == 0
    end = 0
    for place in layout.placements:
        assert place.offset % ALIGNMENT == 0
        assert place.offset >= end
        end = place.offset + place.nbytes
    assert end <= layout.total_bytes


@given(
    st.lists(st.integers(min_value=1, max_value=5_000), min_size=1, max_size=30),
    st.integers(min_value=1, max_value=4_096),
)
def test_split_runs_covers_every_byte_once(sizes: list[int], chunk: int) -> None:
    runs, src, dst = [], 0, 0
    for n in sizes:
        runs.append(CopyRun(src, dst, n))
        src += n + 3  # gaps between tensors in the file
        dst += n + 17
    chunks = split_runs(runs, chunk)
    pairs: list[tuple[int, int]] = []
    for group in chunks:
        first = group[0].src_offset
        last = max(r.src_offset + r.nbytes for r in group)
        assert last - first <= chunk, "a chunk must be one read of at most chunk bytes"
        pairs.extend((r.src_offset + i, r.dst_offset + i) for r in group for i in range(r.nbytes))
    expected = [(r.src_offset + i, r.dst_offset + i) for r in runs for i in range(r.nbytes)]
    assert sorted(pairs) == sorted(expected)
