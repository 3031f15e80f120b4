"""A wake's claim gate waits for as long as its limit keeps rising, and gives up a set time after
the last raise (``engine.claims``): a sleep beside it raises the limit piece by piece, a caller
that went away raises it no more."""

from __future__ import annotations

import threading
import time

import pytest

from omnistage_worker.engine.claims import ClaimGate, ClaimTimeout

WAIT_S = 0.3


def _raise_in_steps(gate: ClaimGate, steps: int, every_s: float) -> threading.Thread:
    """Raise ``gate`` by 1 byte ``steps`` times, ``every_s`` apart (a sleep releasing)."""

    def run() -> None:
        for _ in range(steps):
            time.sleep(every_s)
            gate.raise_limit(gate.limit + 1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_claim_waits_while_the_limit_keeps_rising() -> None:
    gate = ClaimGate(limit=10, held=0, wait_s=WAIT_S)
    raising = _raise_in_steps(gate, steps=8, every_s=WAIT_S / 3)  # ~0.8 s in all
    started = time.monotonic()
    gate.claim(18)  # fits only after the eighth raise
    assert time.monotonic() - started > WAIT_S  # longer than one wait: the raises kept it going
    assert gate.claimed == 18
    raising.join(5)


def test_a_claim_gives_up_a_wait_after_the_last_raise() -> None:
    gate = ClaimGate(limit=10, held=0, wait_s=WAIT_S)
    raising = _raise_in_steps(gate, steps=3, every_s=WAIT_S / 3)  # then nothing more
    with pytest.raises(ClaimTimeout, match=r"not raised for 0\.3 s"):
        gate.claim(100)
    raising.join(5)
    assert gate.claimed == 0 and gate.limit == 13
