"""Preloaded by tests/unit/test_vllm_forkserver.py's fork server: where it was imported, and what
a child forked from that server sees."""

from __future__ import annotations

import os
from multiprocessing.queues import Queue
from typing import Any

IMPORTED_BY = os.getpid()  # the fork server's pid in a child forked from it


def report(queue: Queue[dict[str, Any]]) -> None:
    """The child's pid, the pid that imported this module, and the probe variable."""
    queue.put({"pid": os.getpid(), "imported_by": IMPORTED_BY,
               "env": os.environ.get("OMNISTAGE_FORKSERVER_PROBE")})  # fmt: skip
