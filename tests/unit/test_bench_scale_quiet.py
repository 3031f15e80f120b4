"""bench/scale_quiet.py: a storm's tail ends once the operator's writes stop moving."""

from __future__ import annotations

import asyncio
import time

from bench.scale_quiet import quiet


def test_quiet_waits_for_the_writes_to_stop_and_says_when_they_did() -> None:
    """Bounds that hold however late the loop and its threads run (the CI machine is loaded):
    the tail reaches the last change seen, and the wait ends ``still_s`` after it (in the CI run
    of 0a2a0bf a bound on the wall clock since the test began failed by 0.05 s)."""
    t0 = time.monotonic()
    reads: list[float] = []

    def read() -> dict[str, float]:  # an Event posted at each of the first 8 reads, none after
        reads.append(time.monotonic())
        return {"POST events": float(min(len(reads), 8))}

    tail = asyncio.run(quiet(read, still_s=0.2, poll_s=0.02))
    returned = time.monotonic()
    first, last_change = reads[0], reads[7]
    assert len(reads) > 8
    # quiet() rounds to 0.1 s
    assert last_change - first - 0.05 <= tail <= returned - 0.2 - t0 + 0.05
    assert returned - last_change >= 0.2


def test_quiet_returns_at_once_when_nothing_moves_and_gives_up_at_its_limit() -> None:
    assert asyncio.run(quiet(lambda: {"POST events": 3.0}, still_s=0.05, poll_s=0.01)) == 0.0
    t0 = time.monotonic()
    moving = asyncio.run(quiet(time.monotonic, still_s=10, poll_s=0.01, within_s=0.2))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 2.0
    assert moving >= 0.1
