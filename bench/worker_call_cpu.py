"""The operator's CPU per worker call, by the form its bearer token is handed to grpc (issue 24).

A 1000-stage storm's py-spy (bench/results/scale_1000_pyspy.txt) put 13% of the operator's
samples in grpc.aio's ``_BaseMultiCallable._init_metadata``: metadata given as a tuple of tuples is
checked with ``isinstance(metadata, typing.Sequence)`` and copied into a new
``grpc.aio.Metadata`` on every call, where a ``Metadata`` is taken as it is. This times
``--calls`` unary GetStatus calls of :class:`WorkerClient` against a real worker (the product's
worker server over the scale harness's simulated device, :mod:`tests.scale.simhost`, in its own
process, so the CPU measured here is the client's alone), per form of the token's metadata:

- ``as_is``: the client as the tree has it;
- ``tuple``: ``(("authorization", "Bearer ..."),)`` built per call (the form before 24's cut);
- ``prebuilt``: one ``grpc.aio.Metadata`` kept while the token is the same.

The forms take turns (``--rounds`` rounds of ``--calls`` each, the order rotated every round) so
that drift on a shared machine falls on all of them; per form the median over rounds of the
process's CPU microseconds per call, and ratios against ``tuple`` from the same run. ``--heap``
keeps that many small objects alive (a storm's operator holds hundreds of thousands), so that
collections cost what they do there.

    .venv/bin/python bench/worker_call_cpu.py [--calls 2000 --rounds 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.reporting import code_version, emit  # noqa: E402
from omnistage_operator.decisions.arbiter import WorkerPhase  # noqa: E402
from omnistage_operator.decisions.handover import WorkerUnavailable  # noqa: E402
from omnistage_operator.k8s.worker_client import WorkerClient  # noqa: E402
from tests.cluster.localnode.simlaunch import SimHostClient  # noqa: E402
from tests.fakegpu.device import FakeGpu  # noqa: E402
from tests.fakegpu.model import Device, MiB  # noqa: E402

TOKEN = "bench-token"
IP = "127.77.9.2"


class TupleClient(WorkerClient):
    """The token as a tuple of tuples, built per call."""

    @property
    def _metadata(self) -> Any:
        token = self._token() if callable(self._token) else self._token
        return (("authorization", f"Bearer {token}"),) if token else ()


class PrebuiltClient(WorkerClient):
    """One ``grpc.aio.Metadata`` kept while the token stays the same."""

    _kept: tuple[str | None, Any] = (None, grpc.aio.Metadata())

    @property
    def _metadata(self) -> Any:
        token = self._token() if callable(self._token) else self._token
        if token != self._kept[0]:
            md = grpc.aio.Metadata(("authorization", f"Bearer {token}")) if token else ()
            self._kept = (token, md or grpc.aio.Metadata())
        return self._kept[1]


FORMS: dict[str, Callable[[str], WorkerClient]] = {
    "as_is": lambda target: WorkerClient(target, token=TOKEN),
    "tuple": lambda target: TupleClient(target, token=TOKEN),
    "prebuilt": lambda target: PrebuiltClient(target, token=TOKEN),
}


async def _ready(client: WorkerClient, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if (await client.get_status(2.0)).phase is not WorkerPhase.LOADING:
                return
        except WorkerUnavailable:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError("the worker never left LOADING")


async def _round(client: WorkerClient, calls: int) -> tuple[float, float]:
    """CPU and wall-clock microseconds per call over ``calls`` sequential GetStatus calls."""
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(calls):
        await client.get_status(5.0)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return cpu / calls * 1e6, wall / calls * 1e6


async def _measure(work: Path, calls: int, rounds: int) -> dict[str, Any]:
    device = Device(uuid="GPU-bench-0", total=1024 * MiB, reserve=16 * MiB, context=64 * MiB)
    FakeGpu.create(work / "gpu-0", device)
    (work / "model").mkdir()
    (work / "token").write_text(TOKEN)
    env = {"OMNISTAGE_FAKE_GPU": str(work / "gpu-0"), "OMNISTAGE_SIM_WEIGHTS": str(100 * MiB)}
    argv = [
        "/usr/bin/omnistage-worker",
        "--runner", "ar", "--backend", "transformers", "--model", str(work / "model"),
        f"--host={IP}", "--port", "50051", "--initial-state", "active", "--sleep-level", "1",
        "--token-file", str(work / "token"), "--device", "cpu",
    ]  # fmt: skip
    host = SimHostClient(0, work / "sim.sock", work / "sim.log")
    await host.start()
    clients = {name: make(f"{IP}:50051") for name, make in FORMS.items()}
    try:
        await host.launch("w", argv, env)
        for client in clients.values():
            await _ready(client)
            await _round(client, 200)  # warm: the channel connected, caches filled
        cpu: dict[str, list[float]] = {name: [] for name in FORMS}
        wall: dict[str, list[float]] = {name: [] for name in FORMS}
        names = list(FORMS)
        for r in range(rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                c, w = await _round(clients[name], calls)
                cpu[name].append(c)
                wall[name].append(w)
    finally:
        for client in clients.values():
            await client.close()
        await host.close()
    base = statistics.median(cpu["tuple"])
    return {
        name: {
            "cpu_us_per_call_median": round(statistics.median(cpu[name]), 1),
            "cpu_us_per_call_rounds": [round(v, 1) for v in cpu[name]],
            "wall_us_per_call_median": round(statistics.median(wall[name]), 1),
            "cpu_vs_tuple": round(statistics.median(cpu[name]) / base, 3),
        }
        for name in FORMS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000, help="calls per form per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--heap", type=int, default=300_000, help="small objects kept alive")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    heap = [{"i": i} for i in range(args.heap)]  # noqa: F841 (alive while measuring)
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="worker-call-cpu-") as work:
        forms = asyncio.run(_measure(Path(work), args.calls, args.rounds))
    emit(
        {
            "bench": "worker_call_cpu",
            "command": " ".join(sys.argv),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "code": code_version(REPO),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
            "grpcio": grpc.__version__,
            "load_avg_at_start": round(load, 2),
            "calls": args.calls,
            "rounds": args.rounds,
            "heap_objects": args.heap,
            "forms": forms,
        },
        args.out,
    )


if __name__ == "__main__":
    main()
