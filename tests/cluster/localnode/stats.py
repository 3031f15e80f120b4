"""localnode's own figures: what it asks of the API server and the CPU it uses."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from pathlib import Path

from tests.cluster.localnode.api import Api
from tests.cluster.localnode.kubelet import Kubelet

STATS_FILE = "localnode-stats.json"
STATS_SECONDS = 5.0


def _rss() -> int:
    """This process's resident memory now (bytes)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


async def report(api: Api, kubelet: Kubelet, path: Path) -> None:
    """Write localnode's own figures every few seconds: API requests (total, by verb, per
    second over the last interval), CPU seconds, pods running, nodes."""
    last_total, last_cpu, last_t = 0, 0.0, time.monotonic()
    while True:
        await asyncio.sleep(STATS_SECONDS)
        usage = resource.getrusage(resource.RUSAGE_SELF)
        cpu = usage.ru_utime + usage.ru_stime
        total = sum(api.requests.values())
        now = time.monotonic()
        elapsed = max(now - last_t, 1e-6)
        figures = {
            "time": time.time(),
            "nodes": len(kubelet.nodes),
            "pods": len(kubelet.runners),
            "requests_total": total,
            "requests_by_verb": dict(api.requests),
            "requests_per_s": round((total - last_total) / elapsed, 2),
            "cpu_s": round(cpu, 2),
            "cpu_fraction": round((cpu - last_cpu) / elapsed, 3),
            "rss_mib": round(_rss() / 2**20, 1),
            "max_rss_mib": round(usage.ru_maxrss / 1024, 1),
        }
        last_total, last_cpu, last_t = total, cpu, now
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(figures))
        os.replace(tmp, path)
