"""A transition's copies issued at full rate beside a busy Python thread.

Every torch call that reaches the driver releases the GIL and takes it back. When another thread
is running Python meanwhile (the HTTP event loop or gRPC threads serving the requests that
arrive during a wake), taking it back waits until that thread gives it up: at the interpreter's
switch interval, 5 ms by default. On 2 x H200 a level-1 wake beside one busy thread ran at
1.35 GB/s per device instead of 47.5 (``bench/results/multi_gpu_probe.json``,
``engine_settled_gil_busy``): 64 MiB pieces take 1.2 ms each to copy, but each waited up to
5 ms to be issued. :func:`quick_switching` lowers the switch interval while a transition issues
and waits for its copies, so the busy thread gives the GIL back within
:data:`SWITCH_INTERVAL_S`; the pieces themselves go in one call (``pinning.copy_pieces``).

The interval is process-wide state. Holders are counted under a lock: the first one in saves
the interval and lowers it, the last one out restores what the first one saved, so overlapping
transitions (several engines of one process, or a sharded engine's per-device fallback) never
leave it lowered, and none restores it while another still issues.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

SWITCH_INTERVAL_S: float | None = 1e-4
"""The switch interval while a transition runs: a busy thread hands the GIL back within 0.1 ms,
a tenth of one 64 MiB piece's copy (1.2 ms), so each return of the transition to Python (after
its allocation, issue, waits) waits at most that; None leaves the interval alone (the probe's
``engine_settled_gil_busy_no_switch``). On CPU, ``bench/gil_switch_cpu.py``: 128 calls that
release the GIL beside a busy thread took 832 ms at 5 ms and 112 ms at 0.1 ms (37 ms alone)."""


class _Held:
    """Who holds the lowered interval, and what it was before the first of them."""

    lock = threading.Lock()
    holders = 0
    saved = 0.0


@contextlib.contextmanager
def quick_switching(interval: float | None = None) -> Iterator[None]:
    """While inside, the interpreter's switch interval is at most ``interval`` (default
    :data:`SWITCH_INTERVAL_S`); restored when the last holder leaves."""
    wanted = SWITCH_INTERVAL_S if interval is None else interval
    if wanted is None:
        yield
        return
    with _Held.lock:
        if _Held.holders == 0:
            _Held.saved = sys.getswitchinterval()
        _Held.holders += 1
        if wanted < sys.getswitchinterval():  # never raised by a later holder
            sys.setswitchinterval(wanted)
    try:
        yield
    finally:
        with _Held.lock:
            _Held.holders -= 1
            if _Held.holders == 0:
                sys.setswitchinterval(_Held.saved)
