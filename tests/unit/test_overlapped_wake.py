"""An overlapped hand-over in the engine (issue 23): the incoming stage's wake takes its device
pieces under a claim limit raised by what the outgoing stage's sleep gives back.

Two tiny Llamas share one simulated device (:class:`tests.unit.cpu_pieces.SimDevice`) with room
for one of them and a piece more; a piece that does not fit is refused as the driver refuses
it, and a copy into a piece not yet mapped is lost. The test plays the caller's part: it raises
the waking engine's limit by each piece the sleeping engine reports released.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch
from transformers import LlamaForCausalLM

from omnistage_worker.engine import WeightEngine, claims, flat_weights
from omnistage_worker.engine.claims import ClaimGate, ClaimTimeout
from omnistage_worker.engine.pinning import Hold, held, pieces
from omnistage_worker.engine.vmm_driver import OutOfMemoryError
from tests.unit.cpu_pieces import PIECE, CpuPieces, SimDevice
from tests.unit.test_engine_sharded import logits, tiny_llama

CPU = torch.device("cpu")


class Stage:
    """A tiny Llama on the shared simulated device, its pieces logged as ``<name> map k``."""

    def __init__(self, name: str, sim: SimDevice, log: list[str], scale: float) -> None:
        self.model: LlamaForCausalLM = tiny_llama(tied=False)
        with torch.no_grad():
            for p in self.model.parameters():
                p.mul_(scale)
        self.name = name

        def make(nbytes: int, device: torch.device, gate: ClaimGate | None) -> CpuPieces:
            mine: list[str] = []
            buffer = CpuPieces(nbytes, device, mine, gate, sim)
            buffer.log = _Prefixed(log, name)
            if gate is None:
                log.extend(f"{name} {e}" for e in mine)
            return buffer

        self.engine = WeightEngine({"model": self.model}, CPU, device_pieces=make)


class _Prefixed(list[str]):
    """A log that writes its entries into a shared one, named by stage."""

    def __init__(self, shared: list[str], name: str) -> None:
        super().__init__()
        self.shared, self.name = shared, name

    def append(self, entry: str) -> None:
        self.shared.append(f"{self.name} {entry}")


@pytest.fixture(autouse=True)
def fine_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flat_weights, "CHUNK_BYTES", 1024)  # 4 copies per 4 KiB piece


def two_stages(log: list[str]) -> tuple[Stage, Stage, SimDevice, torch.Tensor, torch.Tensor]:
    """A awake, B asleep at level 1, on a device with room for one of them and a piece."""
    sim = SimDevice(capacity=1 << 40)
    a, b = Stage("a", sim, log, 1.0), Stage("b", sim, log, 1.5)
    b.engine.activate()
    expected_b = logits(b.model)
    b.engine.sleep(1)
    a.engine.activate()
    expected_a = logits(a.model)
    assert a.engine.flat_bytes == b.engine.flat_bytes
    sim.capacity = sim.used + PIECE
    log.clear()
    return a, b, sim, expected_a, expected_b


def test_the_wake_takes_only_pieces_the_sleep_gave_back() -> None:
    log: list[str] = []
    a, b, sim, expected_a, expected_b = two_stages(log)
    gate = ClaimGate(limit=sim.capacity - sim.used, held=0)  # B holds nothing on the device
    woke: list[object] = []

    def wake_b() -> None:
        with claims.gated(gate):
            woke.append(b.engine.wake())

    waking = threading.Thread(target=wake_b)
    waking.start()
    deadline = time.monotonic() + 30
    while "b map 0" not in log:  # B takes the one piece of free room, then waits for A
        assert time.monotonic() < deadline and waking.is_alive(), log
        time.sleep(0.001)
    with claims.watching_releases(lambda n: gate.raise_limit(gate.limit + n)):
        a.engine.sleep(1)
    waking.join(30)
    assert not waking.is_alive() and woke, "the wake did not finish"
    assert torch.equal(logits(b.model), expected_b)
    assert sim.peak <= sim.capacity
    # B's second piece came only after A's first release: the limit held it back.
    assert log.index("b map 1") > log.index("a release 0"), log
    b.engine.sleep(1)
    a.engine.wake()
    assert torch.equal(logits(a.model), expected_a)


@pytest.mark.parametrize(
    ("gate", "error", "match"),
    [
        (None, OutOfMemoryError, "out of memory"),  # as a GPU refuses it: the gate matters
        (ClaimGate(limit=PIECE, held=0, wait_s=0.2), ClaimTimeout, "claim limit 4096 bytes"),
    ],
    ids=["without_a_gate_the_device_refuses", "a_limit_never_raised_times_out"],
)
def test_a_wake_without_its_room_fails_and_leaves_the_stage_asleep(
    gate: ClaimGate | None, error: type[Exception], match: str
) -> None:
    log: list[str] = []
    a, b, sim, _, expected_b = two_stages(log)
    a_holds = sim.used
    with contextlib.ExitStack() as stack:
        if gate is not None:
            stack.enter_context(claims.gated(gate))
        with pytest.raises(error, match=match):
            b.engine.wake()
    assert b.engine.level == 1 and sim.used == a_holds  # nothing of B kept
    a.engine.sleep(1)
    b.engine.wake()
    assert torch.equal(logits(b.model), expected_b)


def test_a_gate_counts_claims_and_refuses_a_lower_limit() -> None:
    gate = ClaimGate(limit=100, held=40)
    gate.claim(60)
    assert gate.claimed == 100
    with pytest.raises(ValueError, match="below the current 100"):
        gate.raise_limit(99)
    done = threading.Event()

    def claim() -> None:
        gate.claim(10)
        done.set()

    waiter = threading.Thread(target=claim)
    waiter.start()
    assert not done.wait(0.1)  # 110 > 100: it waits
    gate.raise_limit(110)
    assert done.wait(5) and gate.claimed == 110
    waiter.join()
    gate.cancel("the wake ended")
    with pytest.raises(ClaimTimeout, match="the wake ended"):
        gate.claim(1)
    with pytest.raises(ValueError, match="above 0"):
        ClaimGate(limit=0, held=0)


def test_holds_map_each_device_piece_before_the_first_copy_into_it() -> None:
    src = torch.zeros(10, dtype=torch.uint8)
    batch = pieces(torch.empty(10, dtype=torch.uint8), src, 0, 3)  # copies of 3, 3, 3, 1
    mapped: list[int] = []
    steps = held(batch, [4, 8, 10], mapped.append)
    kinds = [s[1].numel() if isinstance(s, tuple) else "hold" for s in steps]
    assert kinds == ["hold", 3, "hold", 3, "hold", 3, 1]  # 0-3 in piece 0; 3-6 reaches piece 1
    for s in steps:
        if isinstance(s, Hold):
            s.before()
    assert mapped == [4, 8, 10]
    with pytest.raises(ValueError, match="end at 8, short of 9"):
        held(batch, [4, 8], mapped.append)
