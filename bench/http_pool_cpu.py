"""The operator's HTTP pool bookkeeping: httpcore's own pass against ``k8s.http_pool._Pool``.

httpcore 1.0's pool runs ``_assign_requests_to_connections`` each time a request starts or
ends; with ``kube.KEEP_CONNECTIONS`` (32) idle connections kept it counted them once per idle
connection (32 x 32 ``is_idle`` calls). This keeps 32 real connections open to a local HTTP/1.1
server in another process (keep-alive, a small JSON answer), then, on the operator's transport
(``http_pool.transport``) with the pool's class set to httpcore's or ours in turn:

- ``assign_us``: microseconds per call of the pass alone (``--calls`` calls, nothing queued);
- ``request_cpu_us``: this process's CPU microseconds per request over ``--requests``
  sequential GETs through httpx (the pool's pass twice per request, and everything else a
  request costs the client), ``--rounds`` rounds taking turns, the median.

    .venv/bin/python bench/http_pool_cpu.py [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpcore
import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.reporting import code_version, emit  # noqa: E402
from omnistage_operator.k8s import http_pool  # noqa: E402
from omnistage_operator.k8s.kube import KEEP_IDLE_S  # noqa: E402

KEPT = 32
BODY = b'{"kind":"Event","apiVersion":"v1","metadata":{"name":"x"}}'


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    while True:
        line = await reader.readline()
        if not line:
            break
        while line not in (b"\r\n", b""):
            line = await reader.readline()
        writer.write(head % len(BODY) + BODY)
        await writer.drain()
    writer.close()


def _serve(port: Any) -> None:
    async def main() -> None:
        server = await asyncio.start_server(_answer, "127.0.0.1", 0, backlog=256)
        port.value = server.sockets[0].getsockname()[1]
        async with server:
            await server.serve_forever()

    asyncio.run(main())


POOLS: dict[str, type[httpcore.AsyncConnectionPool]] = {
    "httpcore": httpcore.AsyncConnectionPool,
    "ours": http_pool._Pool,
}


async def _measure(port: int, calls: int, requests: int, rounds: int) -> dict[str, Any]:
    limits = httpx.Limits(
        max_connections=KEPT, max_keepalive_connections=KEPT, keepalive_expiry=KEEP_IDLE_S
    )
    transport = http_pool.transport(False, limits)
    pool = transport._pool
    url = f"http://127.0.0.1:{port}/api/v1/namespaces/x/events"
    async with httpx.AsyncClient(transport=transport) as client:
        await asyncio.gather(*(client.get(url) for _ in range(KEPT)))
        kept = len(pool.connections)
        assign: dict[str, list[float]] = {name: [] for name in POOLS}
        cpu: dict[str, list[float]] = {name: [] for name in POOLS}
        names = list(POOLS)
        for r in range(rounds):
            for name in names[r % 2 :] + names[: r % 2]:
                pool.__class__ = POOLS[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    pool._assign_requests_to_connections()
                assign[name].append((time.perf_counter() - t0) / calls * 1e6)
                if len(pool.connections) != kept:
                    raise RuntimeError(f"{len(pool.connections)} connections kept, not {kept}")
                c0 = time.process_time()
                for _ in range(requests):
                    await client.get(url)
                cpu[name].append((time.process_time() - c0) / requests * 1e6)
                if len(pool.connections) != kept:
                    raise RuntimeError(f"{len(pool.connections)} connections kept, not {kept}")
        pool.__class__ = http_pool._Pool
    return {
        "connections_kept": kept,
        **{
            name: {
                "assign_us_median": round(statistics.median(assign[name]), 1),
                "request_cpu_us_median": round(statistics.median(cpu[name]), 1),
                "request_cpu_us_rounds": [round(v, 1) for v in cpu[name]],
            }
            for name in POOLS
        },
        "request_cpu_ours_vs_httpcore": round(
            statistics.median(cpu["ours"]) / statistics.median(cpu["httpcore"]), 3
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="passes timed per round")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    port = multiprocessing.Value("i", 0)
    server = multiprocessing.Process(target=_serve, args=(port,), daemon=True)
    server.start()
    try:
        deadline = time.monotonic() + 30
        while port.value == 0:
            if time.monotonic() > deadline or not server.is_alive():
                raise RuntimeError("the local HTTP server did not start")
            time.sleep(0.02)
        load = os.getloadavg()[0]
        result = asyncio.run(_measure(port.value, args.calls, args.requests, args.rounds))
    finally:
        server.terminate()
        server.join(5)
    emit(
        {
            "bench": "http_pool_cpu",
            "command": " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "code": code_version(REPO),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "httpcore": httpcore.__version__,
            "load_avg_at_start": round(load, 2),
            **vars(args) | {"out": str(args.out) if args.out else None},
            **result,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
