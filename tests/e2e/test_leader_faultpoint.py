"""The real ``omnistage-operator`` CLI with one test-only fault point (no tests here).

Run as ``python -m tests.e2e.test_leader_faultpoint <operator flags>``. When the file named by
``OMNISTAGE_E2E_STOP_BEFORE_WAKE`` exists at the moment the operator is about to send a WakeUp
(after the port's last ``leading()`` check: ``KubeGroupPort.wake`` checks, then calls
``WorkerClient.wake``), the operator deletes the file and SIGSTOPs itself. A test can thus
freeze a leader with an order already decided, let another replica take over, and resume it:
the decided order then reaches the worker late, carrying the old epoch.

When the file named by ``OMNISTAGE_E2E_BUSY_BEFORE_WAKE`` exists at that moment, the operator
deletes it, reads a number of seconds from it and keeps its event loop busy that long (pure Python
work: the process runs, its event loop does not), as a storm of rounds would. This imports nothing
but the operator, so the process starts as fast as the real one.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any

STOP_BEFORE_WAKE = "OMNISTAGE_E2E_STOP_BEFORE_WAKE"
BUSY_BEFORE_WAKE = "OMNISTAGE_E2E_BUSY_BEFORE_WAKE"


def _busy(marker: str) -> None:
    """Keep this thread (the event loop's) computing for the seconds the armed marker names."""
    try:
        with open(marker) as armed:
            seconds = float(armed.read().strip() or "0")
        os.unlink(marker)
    except (FileNotFoundError, ValueError):
        return
    print(f"FAULT POINT: event loop busy for {seconds}s before WakeUp")
    sys.stdout.flush()
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        sum(i * i for i in range(1000))
    print("FAULT POINT: event loop free again")
    sys.stdout.flush()


def install() -> None:
    """Wrap ``WorkerClient.wake`` with the fault point (only when the variable is set)."""
    marker = os.environ.get(STOP_BEFORE_WAKE)
    busy = os.environ.get(BUSY_BEFORE_WAKE)
    if not marker and not busy:
        return
    from omnistage_operator.decisions.facts import AckFacts
    from omnistage_operator.k8s import worker_client

    original = worker_client.WorkerClient.wake

    async def wake(self: worker_client.WorkerClient, *args: Any, **kwargs: Any) -> AckFacts:
        if busy:
            _busy(busy)
        if not marker:
            return await original(self, *args, **kwargs)
        try:
            os.unlink(marker)  # armed once: the test created the file
        except FileNotFoundError:
            pass
        else:
            epoch = kwargs.get("epoch")
            print(f"FAULT POINT: stopping before WakeUp to {self.target} (epoch {epoch})")
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGSTOP)
            print("FAULT POINT: resumed; sending the WakeUp decided before the stop")
            sys.stdout.flush()
        return await original(self, *args, **kwargs)

    worker_client.WorkerClient.wake = wake  # type: ignore[method-assign]


if __name__ == "__main__":
    install()
    from omnistage_operator.cli import main

    raise SystemExit(main(sys.argv[1:]))
