"""When the operator has gone quiet after a storm, so that bench/scale.py can count a storm's
CPU with its tail (``--settle``).

A storm's window ends when every group has converged, but the operator still has work of it
left then: Events waiting for their lane (4 at once), follow-up rounds and their status writes.
Without ``--settle`` that work lands in the next window, and how much of it does grows with the
storm (at 1000 stages on the 2-core VM the OnDemand storm's tail ran 10-15 s past convergence,
with a status write and three Events per group). Quiet is the API server answering none of the
operator's writes (Events, stage status, pods) for ``still_s``: no other process of the harness
writes them while no storm runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping

from bench.scale_probe import apiserver_requests
from tests.cluster.controlplane import ControlPlane

# The operator's writes (the bench's own spec patches only during a storm).
WRITES = ("POST events", "PATCH events", "PATCH omnistages/status", "POST pods", "DELETE pods")


def writes(cp: ControlPlane) -> dict[str, float]:
    """The API server's answered operator writes so far (``WRITES``)."""
    counts = apiserver_requests(cp)
    return {k: counts.get(k, 0.0) for k in WRITES}


async def quiet(
    read: Callable[[], Mapping[str, float]],
    *,
    still_s: float = 4.0,
    poll_s: float = 1.0,
    within_s: float = 900.0,
) -> float:
    """Wait until ``read()`` (the writes so far, read in a thread) stayed the same for
    ``still_s`` (at most ``within_s``): the seconds until it last changed (0: quiet already)."""
    t0 = time.monotonic()
    last, since = await asyncio.to_thread(read), t0
    while time.monotonic() - t0 < within_s:
        await asyncio.sleep(poll_s)
        now = await asyncio.to_thread(read)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s:
            break
    return round(since - t0, 1)
