"""The client's CPU per API request on the operator's HTTP transport (``k8s.http_pool``).

httpcore 1.0's pool runs ``_assign_requests_to_connections`` each time a request starts or
ends; with ``kube.KEEP_CONNECTIONS`` (32) idle connections kept it counted them once per idle
connection (32 x 32 ``is_idle`` calls); and httpcore writes a request's head and body in two
sends. Three variants of ``http_pool.transport``, each a client with 32 real connections open to
a local HTTP/1.1 server in another process (keep-alive, a small JSON answer; plain HTTP, where
the API server's is TLS: one TLS record fewer per request is not counted here):
``httpcore`` (httpcore's pass, head and body sent apart), ``pool`` (``http_pool._Pool``'s pass)
and ``ours`` (the pass and the head held for its body, as the operator runs). Per variant:

- ``assign_us``: microseconds per call of the pass alone (``--calls`` calls, nothing queued);
- ``get_cpu_us`` and ``patch_cpu_us``: this process's CPU microseconds per request over
  ``--requests`` sequential GETs, then PATCHes with a small JSON body (a status write), through
  httpx; ``--rounds`` rounds, the variants taking turns, the median.

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
from collections.abc import Callable, Coroutine
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
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        if not line:
            break
        await reader.readexactly(length)
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


class _SeparateStream(http_pool._Stream):
    """The stream as before the head was held: every write goes out as it comes."""

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:  # noqa: ASYNC109
        await self._inner.write(buffer, timeout)


# variant: (the pool's class, the streams' class)
VARIANTS: dict[str, tuple[type[httpcore.AsyncConnectionPool], type[http_pool._Stream]]] = {
    "httpcore": (httpcore.AsyncConnectionPool, _SeparateStream),
    "pool": (http_pool._Pool, _SeparateStream),
    "ours": (http_pool._Pool, http_pool._Stream),
}
PATCH = {"status": {"state": "Asleep", "lastAck": {"freedBytes": 1 << 30, "source": "nvml"}}}


async def _client(variant: str, url: str) -> tuple[httpx.AsyncClient, Any]:
    """A client of ``variant`` with ``KEPT`` connections open to ``url``."""
    limits = httpx.Limits(
        max_connections=KEPT, max_keepalive_connections=KEPT, keepalive_expiry=KEEP_IDLE_S
    )
    pool_class, stream_class = VARIANTS[variant]
    original = http_pool._Stream
    http_pool._Stream = stream_class  # type: ignore[misc]  # what the backend wraps with
    try:
        transport = http_pool.transport(False, limits)
        client = httpx.AsyncClient(transport=transport)
        await asyncio.gather(*(client.get(url) for _ in range(KEPT)))
    finally:
        http_pool._Stream = original  # type: ignore[misc]
    transport._pool.__class__ = pool_class
    return client, transport._pool


async def _measure(port: int, calls: int, requests: int, rounds: int) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/apis/omnistage.io/v1alpha1/namespaces/x/omnistages/s/status"
    clients = {name: await _client(name, url) for name in VARIANTS}
    kept = {name: len(pool.connections) for name, (_, pool) in clients.items()}
    assign: dict[str, list[float]] = {name: [] for name in VARIANTS}
    get: dict[str, list[float]] = {name: [] for name in VARIANTS}
    patch: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    try:
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                client, pool = clients[name]
                t0 = time.perf_counter()
                for _ in range(calls):
                    pool._assign_requests_to_connections()
                assign[name].append((time.perf_counter() - t0) / calls * 1e6)
                c0 = time.process_time()
                for _ in range(requests):
                    await client.get(url)
                get[name].append((time.process_time() - c0) / requests * 1e6)
                c0 = time.process_time()
                for _ in range(requests):
                    await client.patch(url, json=PATCH)
                patch[name].append((time.process_time() - c0) / requests * 1e6)
                if len(pool.connections) != KEPT:
                    raise RuntimeError(f"{name}: {len(pool.connections)} connections, not {KEPT}")
    finally:
        for client, _ in clients.values():
            await client.aclose()
    med = {k: {n: statistics.median(v[n]) for n in VARIANTS} for k, v in
           (("assign", assign), ("get", get), ("patch", patch))}  # fmt: skip
    return {
        "connections_kept": kept,
        **{
            name: {
                "assign_us_median": round(med["assign"][name], 1),
                "get_cpu_us_median": round(med["get"][name], 1),
                "patch_cpu_us_median": round(med["patch"][name], 1),
                "get_cpu_us_rounds": [round(v, 1) for v in get[name]],
                "patch_cpu_us_rounds": [round(v, 1) for v in patch[name]],
            }
            for name in VARIANTS
        },
        "vs_httpcore": {
            name: {
                "get_cpu": round(med["get"][name] / med["get"]["httpcore"], 3),
                "patch_cpu": round(med["patch"][name] / med["patch"]["httpcore"], 3),
            }
            for name in ("pool", "ours")
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="passes timed per round")
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    measured = run_against_local_server(
        lambda port: _measure(port, args.calls, args.requests, args.rounds)
    )
    emit_cpu_report("http_pool_cpu", args, {"httpcore": httpcore.__version__}, measured)


def run_against_local_server(
    measure: Callable[[int], Coroutine[Any, Any, dict[str, Any]]],
) -> tuple[float, dict[str, Any]]:
    """Start the local HTTP/1.1 server in a process of its own, run ``measure(port)`` against
    it; the load average at the start and what it measured."""
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
        return load, asyncio.run(measure(port.value))
    finally:
        server.terminate()
        server.join(5)


def emit_cpu_report(
    bench: str, args: argparse.Namespace, versions: dict[str, str],
    measured: tuple[float, dict[str, Any]],
) -> None:  # fmt: skip
    """The report of a client-CPU bench: its command, date, code, machine, the library
    versions, the load at its start, its flags and what it measured."""
    load, result = measured
    emit(
        {
            "bench": bench,
            "command": " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "code": code_version(REPO),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            **versions,
            "load_avg_at_start": round(load, 2),
            **vars(args) | {"out": str(args.out) if args.out else None},
            **result,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
