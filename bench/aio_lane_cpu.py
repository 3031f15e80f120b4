"""The client's CPU per API request: the operator's httpx transport against its aiohttp lane.

Both as the operator runs them (``http_pool.transport`` in an httpx client, as kr8s's; an
``aio_lane.AioLane``), each with 32 connections kept to a local HTTP/1.1 server in another
process (bench/http_pool_cpu.py's: keep-alive, a small JSON answer; plain HTTP, where the API
server's is TLS, whose cost is about the same in both). Per variant, this process's CPU
microseconds per status PATCH (a small JSON merge patch), ``--requests`` one after another and
then in bursts of 32 at once, over ``--rounds`` rounds taking turns, the median.

    .venv/bin/python bench/aio_lane_cpu.py [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.http_pool_cpu import (  # noqa: E402
    KEPT,
    PATCH,
    _client,
    emit_cpu_report,
    run_against_local_server,
)
from omnistage_operator.k8s.aio_lane import AioLane  # noqa: E402

PATH = "/apis/omnistage.io/v1alpha1/namespaces/x/omnistages/s/status"
HEADERS = {"Content-Type": "application/merge-patch+json"}


async def _cpu_us(send: Callable[[], Awaitable[Any]], requests: int, burst: int) -> float:
    c0 = time.process_time()
    for _ in range(requests // burst):
        await asyncio.gather(*(send() for _ in range(burst)))
    return (time.process_time() - c0) / (requests // burst * burst) * 1e6


async def _measure(port: int, requests: int, rounds: int) -> dict[str, Any]:
    server = f"http://127.0.0.1:{port}"
    client, _ = await _client("ours", server + PATH)
    lane = AioLane(server, {}, False, limit=KEPT)
    body = json.dumps(PATCH)

    async def httpx_patch() -> None:
        (await client.request("PATCH", server + PATH, content=body, headers=HEADERS)).read()

    async def lane_patch() -> None:
        await lane.request("PATCH", PATH, content=body, headers=HEADERS, read=False)

    await asyncio.gather(*(lane_patch() for _ in range(KEPT)))  # its connections open
    sends = {"httpx": httpx_patch, "aiohttp_lane": lane_patch}
    out: dict[str, dict[str, list[float]]] = {n: {"serial": [], "burst": []} for n in sends}
    try:
        for r in range(rounds):
            for name in list(sends)[r % 2 :] + list(sends)[: r % 2]:
                out[name]["serial"].append(await _cpu_us(sends[name], requests, 1))
                out[name]["burst"].append(await _cpu_us(sends[name], requests, KEPT))
    finally:
        await client.aclose()
        await lane.close()
    if lane.opened != KEPT:
        raise RuntimeError(f"the lane opened {lane.opened} connections, not {KEPT}")
    return {
        name: {
            **{f"patch_cpu_us_{k}_median": round(statistics.median(v), 1) for k, v in by.items()},
            **{f"patch_cpu_us_{k}_rounds": [round(x, 1) for x in v] for k, v in by.items()},
        }
        for name, by in out.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=960, help="requests per round and kind")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    measured = run_against_local_server(lambda port: _measure(port, args.requests, args.rounds))
    emit_cpu_report("aio_lane_cpu", args, {"aiohttp": aiohttp.__version__}, measured)


if __name__ == "__main__":
    main()
