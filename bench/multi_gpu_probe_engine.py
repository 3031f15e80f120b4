"""The worker's own wake for ``bench/multi_gpu_probe.py``: a :class:`ShardedEngine` over a
synthetic model of ``size`` bytes per device (16 blocks of 9 bf16 tensors each per device,
about a Llama decoder layer's count), built on ``meta``, placed by the worker's device map and
materialized on each block's device; its host copies are page-locked to the end before any
measurement, and every wake's flat buffers are compared with their bytes before the first sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch

from bench.threads import run_threads
from omnistage_worker.engine.placement import blocks_of, plan_device_map
from omnistage_worker.engine.sharded import ShardedEngine

Json = dict[str, Any]
BLOCKS_PER_DEVICE = 16
SHARES = (16, 4, 4, 16, 56, 56, 56)
"""Relative sizes of a block's large tensors (q, k, v, o, gate, up, down of a GQA layer)."""
NORM_ELEMENTS = 4096


class Block(torch.nn.Module):
    """Nine tensors: seven large and two norm-sized, ``nbytes`` in all (bf16)."""

    def __init__(self, nbytes: int) -> None:
        super().__init__()
        large = nbytes // 2 - 2 * NORM_ELEMENTS
        sizes = [large * share // sum(SHARES) for share in SHARES] + [NORM_ELEMENTS] * 2
        for j, n in enumerate(sizes):
            self.register_parameter(
                f"w{j}", torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16))
            )


class Synthetic(torch.nn.Module):
    def __init__(self, blocks: int, block_bytes: int) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block(block_bytes) for _ in range(blocks))


T = TypeVar("T")


def together(n: int, step: Callable[[int], T]) -> list[T]:
    """``step(i)`` on ``n`` threads released at once by a barrier; their results in order."""
    results: dict[int, T] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = step(i)
        except BaseException as exc:
            errors.append(exc)

    run_threads(n, run)
    if errors:
        raise errors[0]
    return [results[i] for i in range(n)]


class busy_thread:
    """While inside: a Python thread that never waits (holds the GIL for its switch interval)."""

    def __init__(self, on: bool) -> None:
        self.on = on
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._spin, daemon=True)

    def _spin(self) -> None:
        n = 0
        while not self.stop.is_set():
            n += 1

    def __enter__(self) -> None:
        if self.on:
            self.thread.start()

    def __exit__(self, *exc: object) -> None:
        if self.on:
            self.stop.set()
            self.thread.join()


class EngineRig:
    """The engine, its bytes before the first sleep, and each wake's per-device figures."""

    def __init__(self, devices: Sequence[torch.device], size: int, cuda: bool) -> None:
        self.cuda = cuda
        blocks = BLOCKS_PER_DEVICE * len(devices)
        with torch.device("meta"):
            model = Synthetic(blocks, size // BLOCKS_PER_DEVICE)
        modules = {"model": model}
        device_map = plan_device_map(blocks_of(modules, no_split=["Block"]), len(devices))
        for name, ordinal in device_map["model"].items():
            part = model.get_submodule(name) if name else model
            part.to_empty(device=devices[ordinal])
            for p in part.parameters():
                p.data.view(torch.int16).random_()
        self.engine = ShardedEngine(modules, list(devices), device_map, None)
        self.engine.activate()
        for shard in self.engine.shards:  # every later sleep copies at the page-locked rate
            pinner = getattr(shard, "_pinner", None)
            if pinner is not None:
                pinner.finish()
        self.reference = [self._flat(i).clone() for i in range(len(devices))]
        self._allocs: list[list[float]] = [[] for _ in devices]
        for i, shard in enumerate(self.engine.shards):
            self._time_allocations(shard, self._allocs[i])
        self.last_sleep: list[Json] = []

    @staticmethod
    def _time_allocations(shard: Any, record: list[float]) -> None:
        original = shard._new_flat

        def timed(*args: Any, **kwargs: Any) -> torch.Tensor:
            started = time.perf_counter()
            flat: torch.Tensor = original(*args, **kwargs)
            record.append(time.perf_counter() - started)
            return flat

        shard._new_flat = timed

    def _flat(self, i: int) -> torch.Tensor:
        flat: torch.Tensor | None = self.engine.shards[i]._flat
        assert flat is not None, "the engine is asleep"
        return flat

    def sleep(self) -> None:
        """Level 1 (when awake); each device's sleep figures are kept for the report."""
        if self.engine.level != 0:
            self.last_sleep = []  # asleep already: no sleep figures for the next wake
            return
        self.engine.sleep(1)
        self.last_sleep = [{"seconds": s.seconds, "bytes": s.bytes_moved} for s in self.engine.last]

    def wake(self, alone: bool = False, threads: bool = False) -> list[Json]:
        """One wake of every device at once, as the worker runs it (``alone``: one device after
        the other, each shard's own wake; ``threads``: each shard's own wake on a thread of
        its own, released by a barrier: the engine's issue before); per device its engine
        seconds and allocation."""
        for record in self._allocs:
            record.clear()
        if alone or threads:
            started = time.perf_counter()
            if alone:
                last = [shard.wake() for shard in self.engine.shards]
            else:
                shards = self.engine.shards
                last = together(len(shards), lambda i: shards[i].wake())
            wall = time.perf_counter() - started
        else:
            stats = self.engine.wake()
            last, wall = self.engine.last, stats.seconds
        out = []
        for i, shard_stats in enumerate(last):
            out.append(
                {
                    "seconds": shard_stats.seconds,
                    "bytes": self.engine.shards[i].flat_bytes,
                    "alloc_s": sum(self._allocs[i]),
                    "wall_s": wall,
                    "sleep_before": self.last_sleep[i] if self.last_sleep else None,
                }
            )
        return out

    def bytes_ok(self) -> list[bool]:
        return [torch.equal(self._flat(i), ref) for i, ref in enumerate(self.reference)]

    def close(self) -> None:
        self.reference = []
        self.engine.close()
