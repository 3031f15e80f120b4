"""bench/scale_quiet.py: a storm's tail ends once the operator's writes stop moving."""

from __future__ import annotations

import asyncio
import time

from bench.scale_quiet import quiet


def test_quiet_waits_for_the_writes_to_stop_and_says_when_they_did() -> None:
    t0 = time.monotonic()

    def read() -> dict[str, float]:  # Events posted until 0.3 s in, none after
        return {"POST events": min(time.monotonic() - t0, 0.3) // 0.05}

    tail = asyncio.run(quiet(read, still_s=0.2, poll_s=0.02))
    assert 0.25 <= tail <= 0.45
    assert time.monotonic() - t0 >= tail + 0.15  # the still time after the last (tail: 0.1 s)


def test_quiet_returns_at_once_when_nothing_moves_and_gives_up_at_its_limit() -> None:
    assert asyncio.run(quiet(lambda: {"POST events": 3.0}, still_s=0.05, poll_s=0.01)) == 0.0
    t0 = time.monotonic()
    moving = asyncio.run(quiet(time.monotonic, still_s=10, poll_s=0.01, within_s=0.2))  # type: ignore[arg-type]
    assert time.monotonic() - t0 < 2.0
    assert moving >= 0.1
