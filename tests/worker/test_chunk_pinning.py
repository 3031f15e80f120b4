"""The host copy page-locked chunk by chunk in the background (off the first token's path).

Real page-locking on the CPU: ``mlock`` (the kernel's ``VmLck`` counts it), gated so a test
decides how many chunks are locked when a sleep comes; the engine's copies must then be exact
whether the pinning finished, is stopped half-way (pageable rest), or is finished first.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from omnistage_worker.engine import pinning
from omnistage_worker.engine.activity import Activity
from omnistage_worker.engine.pinning import ChunkPinner, split_copy
from omnistage_worker.engine.weights import WeightEngine

PAGE = 4096
CHUNK = 4 * PAGE
DEADLINE_S = 10.0

_libc = ctypes.CDLL(None, use_errno=True)


def locked_kib() -> int:
    """This process's page-locked memory, as the kernel counts it."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    raise AssertionError("no VmLck in /proc/self/status")


class GatedMlock:
    """``mlock`` per range, letting only as many ranges through as the test allows."""

    def __init__(self, allowed: int) -> None:
        self.allowed = allowed
        self.calls: list[tuple[int, int]] = []
        self.unlocked: list[tuple[int, int]] = []
        self.cond = threading.Condition()

    def allow(self, more: int) -> None:
        with self.cond:
            self.allowed += more
            self.cond.notify_all()

    def lock(self, ptr: int, nbytes: int) -> None:
        with self.cond:
            self.calls.append((ptr, nbytes))
            self.cond.notify_all()
            if not self.cond.wait_for(lambda: self.allowed > 0, timeout=DEADLINE_S):
                raise TimeoutError("gate never opened")
            self.allowed -= 1
        if _libc.mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes)) != 0:
            raise OSError(ctypes.get_errno(), "mlock failed")

    def unlock(self, ptr: int, nbytes: int) -> None:
        self.unlocked.append((ptr, nbytes))
        _libc.munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))

    def wait_calls(self, n: int) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.calls) >= n, timeout=DEADLINE_S)


def poll(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(pinning, "CHUNK_BYTES", CHUNK)
    yield


def test_chunks_are_locked_in_order_and_unlocked_on_release() -> None:
    before = locked_kib()
    locker = GatedMlock(allowed=1000)
    pinner = ChunkPinner(10 * CHUNK + PAGE, locker, chunk_bytes=CHUNK, pause_s=0.0)
    pinner.finish()
    assert pinner.error is None and pinner.done
    base = pinner.buffer.tensor.data_ptr()
    expected = [(base + i * CHUNK, CHUNK) for i in range(10)] + [(base + 10 * CHUNK, PAGE)]
    assert locker.calls == expected
    assert locked_kib() - before >= (10 * CHUNK + PAGE) // 1024
    pinner.release()
    assert locker.unlocked == expected
    assert locked_kib() == before


def test_hold_keeps_the_pinned_prefix_still() -> None:
    locker = GatedMlock(allowed=2)
    pinner = ChunkPinner(8 * CHUNK, locker, chunk_bytes=CHUNK, pause_s=0.0)
    locker.wait_calls(3)  # two locked, the third waits at the gate
    data = torch.arange(8 * CHUNK, dtype=torch.int64).to(torch.uint8)
    with pinner.hold() as pinned:
        assert pinned == 2 * CHUNK
        locker.allow(100)
        split_copy(pinner.buffer.tensor, data, 0, CHUNK)
        locker.wait_calls(3)
        assert pinner.pinned_bytes == pinned  # the third is locked but not published
    pinner.finish()
    assert pinner.done and pinner.error is None
    assert torch.equal(pinner.buffer.tensor, data)  # locking kept the bytes
    pinner.release()


def test_pinning_waits_for_model_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """No chunk is locked while a request runs; a steady load still lets it end."""
    monkeypatch.setattr(pinning, "MAX_WAIT_S", DEADLINE_S)
    runs = Activity()
    locker = GatedMlock(allowed=1000)
    with runs.busy():
        pinner = ChunkPinner(4 * CHUNK, locker, chunk_bytes=CHUNK, pause_s=0.0, activity=runs)
        pinner._thread.join(0.2)  # a window for a pinner that did not wait
        assert locker.calls == [] and pinner.pinned_bytes == 0
    pinner.finish()
    assert pinner.done
    pinner.release()

    monkeypatch.setattr(pinning, "MAX_WAIT_S", 0.01)
    with runs.busy():  # never idle: one chunk per MAX_WAIT_S
        pinner = ChunkPinner(4 * CHUNK, locker, chunk_bytes=CHUNK, pause_s=0.0, activity=runs)
        poll(lambda: pinner.done, "pinned under a steady load")
    pinner.release()


def test_split_copy_never_crosses_a_chunk() -> None:
    src = torch.arange(10 * CHUNK + 123, dtype=torch.int64).to(torch.uint8)
    dst = torch.zeros_like(src)
    pieces = split_copy(dst[100:], src[100:], 100, CHUNK)
    assert torch.equal(dst[100:], src[100:]) and int(dst[:100].sum()) == 0
    assert pieces == 11  # [100, CHUNK), then 9 whole chunks, then the short tail


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(64, 64) for _ in range(4)))


def run(net: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = net(torch.ones(2, 64))
    return out


@pytest.mark.parametrize("wait", [False, True])
def test_sleep_before_the_pinning_finished(wait: bool) -> None:
    """Stopped after 2 chunks: a sleep copies the rest pageable (or finishes first); exact."""
    net = model()
    reference = run(net)
    locker = GatedMlock(allowed=2)
    engine = WeightEngine({"m": net}, torch.device("cpu"), host_locker=locker, wait_for_pin=wait)
    engine.activate()
    pinner = engine._pinner
    assert pinner is not None and pinner.buffer.nbytes > 4 * CHUNK
    locker.wait_calls(3)
    assert torch.equal(run(net), reference)  # the forward ran beside the pinning

    if wait:
        sleeper = threading.Thread(target=engine.sleep, args=(1,))
        sleeper.start()
        poll(pinner._hurry.is_set, "the sleep asked the pinner to finish")
        assert sleeper.is_alive() and engine.level == 0  # waits for the pinning
        locker.allow(1000)
        sleeper.join(DEADLINE_S)
        assert pinner.done and engine.level == 1
    else:
        engine.sleep(1)  # returns with the pinner still stopped at its gate
        assert engine.level == 1 and pinner.pinned_bytes == 2 * CHUNK
    assert engine.device_bytes() == 0
    engine.wake()
    assert torch.equal(run(net), reference)

    locker.allow(1000)
    pinner.finish()
    assert pinner.done and pinner.error is None
    for _ in range(2):  # now every chunk is locked: the same bytes come back
        engine.sleep(1)
        engine.wake()
        assert torch.equal(run(net), reference)
    engine.close()
    poll(lambda: len(locker.unlocked) == len(locker.calls), "every chunk unlocked")
