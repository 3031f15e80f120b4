"""The hand-over round against real worker processes over real gRPC (no Kubernetes).

Two ``omnistage-worker`` processes (a tiny Llama and a tiny diffusers pipeline built here from
configs) share one simulated GPU (:mod:`tests.fakegpu`, with no driver reserve, context or
activations: only the weights are charged), sized so that only one of them fits.
``ProcessPort`` is the hand-over's port with processes instead of pods: ``start`` spawns a
worker asleep, ``fence`` kills it and waits for the exit. The round, the arbiter and the gRPC
client are the operator's own. The order is proven from the workers' ACK timestamps.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from omnistage_operator.decisions.arbiter import GroupMemory, StageFacts, StageIntent, WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, WorkerReport
from omnistage_operator.decisions.handover import (
    GroupObservation,
    RoundOutcome,
    RoundPolicy,
    WorkerUnavailable,
)
from omnistage_operator.decisions.handover.rounds import run_round
from omnistage_operator.k8s.worker_client import WorkerClient
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device
from tests.worker.tiny_models import build_causal_lm, build_diffusion_pipeline

WORKER = str(Path(sys.executable).parent / "omnistage-worker")
REPO = str(Path(__file__).resolve().parents[2])  # the worker imports tests.fakegpu
# Tiny Llama ~81 KiB, tiny SD ~1014 KiB of accounted weights: together they exceed this device.
CAPACITY = 1_100_000
TOKEN = "t0ken-for-tests"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        "ar": build_causal_lm(root / "ar"),
        "sd": build_diffusion_pipeline(root / "sd"),
    }


class ProcessPort:
    """``GroupPort`` over local worker processes sharing one fake device."""

    def __init__(self, tmp: Path, models: dict[str, Path]) -> None:
        self.tmp = tmp
        self.models = models
        self.gpu = FakeGpu.create(
            tmp / "gpu", Device(uuid="GPU-t", total=CAPACITY, reserve=0, context=0, activation=0)
        )
        self.token_file = tmp / "token"
        self.token_file.write_text(TOKEN)
        self.intents: dict[str, StageIntent] = {}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.clients: dict[str, WorkerClient] = {}
        self.started: set[str] = set()
        self.reached: set[str] = set()
        self.acks: list[tuple[str, AckFacts]] = []
        self.fenced: list[str] = []
        self.checkpoints: list[int] = []  # ACKs received when each checkpoint was published

    async def observe(self) -> GroupObservation:
        facts: dict[str, StageFacts] = {}
        reports: list[WorkerReport] = []
        for name in self.intents:
            proc = self.procs.get(name)
            if proc is None or proc.poll() is not None:
                facts[name] = StageFacts(WorkerPhase.ABSENT)
                continue
            try:
                rep = await self.clients[name].get_status(2.0)
            except WorkerUnavailable:
                unseen = name in self.started and name not in self.reached
                facts[name] = StageFacts(
                    WorkerPhase.STARTING if unseen else WorkerPhase.UNREACHABLE
                )
                continue
            self.reached.add(name)
            reports.append(rep)
            facts[name] = rep.stage_facts()
        mem = (
            GroupMemory(max(r.total_bytes for r in reports), min(r.free_bytes for r in reports))
            if reports
            else GroupMemory()
        )
        return GroupObservation(dict(self.intents), facts, mem)

    async def start(self, stage: str) -> None:
        runner, backend, model = {
            "ar": ("ar", "transformers", self.models["ar"]),
            "sd": ("diffusion", "diffusers", self.models["sd"]),
        }[stage]
        port = _free_port()
        log = (self.tmp / f"{stage}.log").open("wb")
        self.procs[stage] = subprocess.Popen(  # noqa: ASYNC220 - returns at once
            [
                WORKER,
                "--runner",
                runner,
                "--backend",
                backend,
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--device",
                "cpu",
                "--initial-state",
                "asleep",
                "--sleep-level",
                "1",
                "--token-file",
                str(self.token_file),
                "--stage",
                stage,
                "--residual-slack",
                "1024.0",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))),
                "OMNISTAGE_MEMORY_PROBE": "tests.fakegpu.probe:from_env",
                "OMNISTAGE_FAKE_GPU": str(self.gpu.dir),
            },
        )
        self.clients[stage] = WorkerClient(f"127.0.0.1:{port}", token=TOKEN)
        self.started.add(stage)
        self.reached.discard(stage)

    async def probe(self, stage: str) -> StageFacts:
        return (await self.observe()).facts[stage]

    async def sleep(
        self,
        stage: str,
        level: int,
        task_id: str,
        *,
        drain_timeout_s: float | None = None,
        timeout_s: float | None = None,
        components: tuple[str, ...] = (),
    ) -> AckFacts:
        if stage not in self.clients:
            raise WorkerUnavailable("no process")
        ack = await self.clients[stage].sleep(level, task_id, 5.0)
        self.acks.append((stage, ack))
        return ack

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        ack = await self.clients[stage].wake(task_id, 60.0)
        self.acks.append((stage, ack))
        return ack

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        self.checkpoints.append(len(self.acks))

    async def fence(self, stage: str, reason: str) -> None:
        proc = self.procs.pop(stage)
        proc.kill()
        await asyncio.to_thread(proc.wait, 30)
        self.fenced.append(stage)

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
            proc.wait(30)


@pytest.fixture
async def port(tmp_path: Path, models: dict[str, Path]) -> AsyncIterator[ProcessPort]:
    p = ProcessPort(tmp_path, models)
    yield p
    for client in p.clients.values():
        await client.close()
    p.stop()


def _ids() -> Iterator[str]:
    n = 0
    while True:
        n += 1
        yield f"t{n}"


async def _converge(port: ProcessPort, want: str, within_s: float = 120.0) -> None:
    ids = _ids()
    deadline = time.monotonic() + within_s
    policy = RoundPolicy(ack_retries=2, backoff_s=0.2, margin_bytes=16 * 1024)
    while time.monotonic() < deadline:
        out = await run_round(port, policy, lambda: next(ids) + f"-{time.time_ns()}")
        assert out.observation is not None
        if out.observation.facts[want].phase is WorkerPhase.ACTIVE:
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{want} not Active within {within_s}s; acks: {port.acks}")


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_switch_sleeps_the_holder_before_waking_the_other(port: ProcessPort) -> None:
    port.intents = {
        "ar": StageIntent("ar", True, requested_active_at=1.0),
        "sd": StageIntent("sd", False),
    }
    await _converge(port, "ar")
    status = await port.clients["ar"].get_status(2.0)
    assert status.phase is WorkerPhase.ACTIVE and status.used_bytes > 0

    port.acks.clear()
    port.intents["sd"] = StageIntent("sd", True, requested_active_at=2.0)
    await _converge(port, "sd")
    (s_stage, sleep_ack), (w_stage, wake_ack) = port.acks
    assert port.checkpoints[-1] == 1  # published with the sleep ACK, before the wake
    assert (s_stage, sleep_ack.op, sleep_ack.ok) == ("ar", "sleep", True)
    assert (w_stage, wake_ack.op, wake_ack.ok) == ("sd", "wake", True)
    assert sleep_ack.freed_bytes > 0 and sleep_ack.used_after_bytes == 0
    # The workers' own clocks: the sleep finished before the wake started.
    assert sleep_ack.finished_at < wake_ack.started_at
    assert wake_ack.used_after_bytes + sleep_ack.used_after_bytes <= CAPACITY
    ar = await port.clients["ar"].get_status(2.0)
    assert ar.phase is WorkerPhase.ASLEEP

    # Both want Active and they do not fit together: the latest ask keeps the memory; a round
    # with unchanged wishes orders nothing (no ping-pong).
    port.acks.clear()
    port.intents["ar"] = StageIntent("ar", True, requested_active_at=1.5)
    out = await run_round(port, RoundPolicy(margin_bytes=16 * 1024), lambda: "steady")
    assert port.acks == [] and out.decision is not None
    assert out.decision.waiting_for("ar") == ("sd",)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_killed_sleeper_is_fenced_and_nothing_wakes_on_a_guess(port: ProcessPort) -> None:
    port.intents = {
        "ar": StageIntent("ar", False),
        "sd": StageIntent("sd", True, requested_active_at=1.0),
    }
    await _converge(port, "sd")
    # The diffusion worker hangs (SIGSTOP): it holds its memory and answers nothing.
    sd = port.procs["sd"]
    sd.send_signal(19)
    port.intents["sd"] = StageIntent("sd", False)
    port.intents["ar"] = StageIntent("ar", True, requested_active_at=2.0)
    port.acks.clear()
    await _converge(port, "ar")
    assert port.fenced == ["sd"]
    assert sd.poll() is not None  # the process is gone before the wake
    assert [(s, a.op) for s, a in port.acks] == [("ar", "wake")]
