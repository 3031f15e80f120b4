"""The fast sleep and wake of vLLM's ``CuMemAllocator``: the plan of :mod:`.vllm_wake_plan` run
over the allocator's records through a small set of device operations (:class:`WakeOps`).

Runs in vLLM's worker process (installed by :mod:`.vllm_wake_cuda`). The operations are
injected so the order of the steps, the kept host buffer and the rollback are tested with plain
Python objects; on the GPU they are vLLM's own ``create_and_map`` / ``unmap_and_release`` (its C
extension, the only way vLLM found to call the driver in the right context), ``cudaMemcpyAsync``
on one dedicated stream, and a host buffer of the exact size page-locked with the driver.

Each sleep and wake logs its phases at info level through vLLM's logger (``vllm.`` names print
in vLLM's processes) as one line ``OMNISTAGE_WAKE_PHASES {json}``, which ``bench/vllm_stage.py``
reads from the worker's log.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from omnistage_worker.runners.vllm_wake_plan import (
    Allocation,
    Backup,
    Phases,
    Step,
    checked_order,
    phase_of,
    plan_sleep,
    plan_wake,
    reuse_buffer,
    sleep_steps,
    wake_steps,
)

log = logging.getLogger("vllm.omnistage.wake")
MARKER = "OMNISTAGE_WAKE_PHASES"
"""Starts the log line with a transition's phases (JSON follows)."""
WAKE_ORDER_ENV = "OMNISTAGE_VLLM_WAKE_ORDER"
"""In the engine's environment: the wake's order (:data:`.vllm_wake_plan.WAKE_ORDERS`)."""


class HostBuffer(Protocol):
    """Host memory of ``nbytes`` at address ``ptr()``, page-locked while it lives."""

    nbytes: int

    def ptr(self) -> int: ...

    def release(self) -> None: ...


class WakeOps(Protocol):
    """The device operations a sleep or wake is made of (``handle``: vLLM's allocation handle)."""

    def create_and_map(self, handle: Any) -> None: ...

    def unmap_and_release(self, handle: Any) -> None: ...

    def copy_async(self, dst: int, src: int, nbytes: int) -> None: ...

    def sync_copies(self) -> None: ...

    def sync_device(self) -> None: ...

    def host_buffer(self, nbytes: int) -> HostBuffer: ...

    def collect_garbage(self) -> None: ...

    def empty_cache(self) -> None: ...


class NoHostBuffer(RuntimeError):
    """The host buffer could not be had; raised before the sleep touched the device."""


def allocations_of(records: Mapping[int, Any]) -> list[Allocation]:
    """vLLM's ``pointer_to_data`` (ptr -> ``AllocationData(handle, tag)``) as plain records."""
    return [Allocation(ptr, int(data.handle[1]), str(data.tag)) for ptr, data in records.items()]


class FastCuMem:
    """One allocator's kept host buffer and backups, and its sleep and wake.

    The buffer is allocated at the first sleep that offloads and reused by every later one that
    fits in it; a sleep that offloads nothing (level 2) gives it back, as does :meth:`close`.
    """

    def __init__(self, ops: WakeOps, order: str = "overlap") -> None:
        self.ops = ops
        self.order = checked_order(order)  # a bad order fails here, not at the first wake
        self.buffer: HostBuffer | None = None
        self.backups: dict[int, Backup] = {}
        self.last: dict[str, Phases] = {}

    @property
    def host_bytes(self) -> int:
        return self.buffer.nbytes if self.buffer is not None else 0

    def _buffer_for(self, needed: int) -> HostBuffer | None:
        capacity = self.buffer.nbytes if self.buffer is not None else None
        if reuse_buffer(capacity, needed):
            return self.buffer
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
        if needed > 0:
            self.buffer = self.ops.host_buffer(needed)
        return self.buffer

    def sleep(
        self, records: Mapping[int, Any], offload_tags: tuple[str, ...] | str | None
    ) -> Phases:
        """Back up the offloaded allocations into the kept buffer and release every one."""
        phases = Phases("sleep")
        started = time.perf_counter()
        plan = plan_sleep(allocations_of(records), offload_tags)
        try:
            buffer = self._buffer_for(plan.buffer_bytes)
        except Exception as exc:
            raise NoHostBuffer(f"no host buffer of {plan.buffer_bytes} bytes: {exc}") from exc
        phases.add("host_buffer", time.perf_counter() - started)
        base = buffer.ptr() if buffer is not None else 0
        backed = frozenset(b.ptr for b in plan.backups)
        self._run(sleep_steps(plan), records, base, backed=backed, phases=phases)
        self.backups = {b.ptr: b for b in plan.backups}
        phases.copy_bytes = plan.backup_bytes
        # as vLLM's own sleep ends: garbage collected, torch's cached blocks given back
        started = time.perf_counter()
        self.ops.collect_garbage()
        phases.add("gc", time.perf_counter() - started)
        started = time.perf_counter()
        self.ops.empty_cache()
        phases.add("empty_cache", time.perf_counter() - started)
        self._report(phases, total_bytes=plan.total_bytes)
        return phases

    def wake_up(self, records: Mapping[int, Any], tags: list[str] | None) -> Phases:
        """Map the woken allocations, filling the backed-up ones from the kept buffer; on a
        failure, release what this wake mapped (the backups stay for another try)."""
        phases = Phases("wake")
        plan = plan_wake(allocations_of(records), tags, self.backups)
        base = self.buffer.ptr() if self.buffer is not None else 0
        if plan.copies and self.buffer is None:
            raise RuntimeError("backups recorded without a host buffer")
        backed = frozenset(b.ptr for b in plan.copies)
        mapped: list[int] = []
        try:
            self._run(
                wake_steps(plan, self.order),
                records,
                base,
                backed=backed,
                phases=phases,
                mapped=mapped,
            )
        except BaseException:
            self._roll_back(records, mapped)
            raise
        for b in plan.copies:
            del self.backups[b.ptr]
        phases.copy_bytes = plan.copy_bytes
        self._report(phases, tags=tags)
        return phases

    def _run(
        self,
        steps: list[Step],
        records: Mapping[int, Any],
        base: int,
        *,
        backed: frozenset[int],
        phases: Phases,
        mapped: list[int] | None = None,
    ) -> None:
        ops = self.ops
        for step in steps:
            started = time.perf_counter()
            if step.op == "sync_device":
                ops.sync_device()
            elif step.op == "copy_d2h" and step.backup is not None:
                ops.copy_async(base + step.backup.offset, step.ptr, step.backup.size)
                phases.copies += 1
            elif step.op == "copy_h2d" and step.backup is not None:
                ops.copy_async(step.ptr, base + step.backup.offset, step.backup.size)
                phases.copies += 1
            elif step.op == "map":
                ops.create_and_map(records[step.ptr].handle)
                phases.maps += 1
                if mapped is not None:
                    mapped.append(step.ptr)
            elif step.op == "release":
                ops.unmap_and_release(records[step.ptr].handle)
                phases.releases += 1
            elif step.op == "sync_copies":
                ops.sync_copies()
            else:
                raise ValueError(f"unknown step {step}")
            phases.add(phase_of(step, backed), time.perf_counter() - started)

    def _roll_back(self, records: Mapping[int, Any], mapped: list[int]) -> None:
        """Wait for the copies already issued, then release what was mapped."""
        try:
            self.ops.sync_copies()
        except Exception:
            log.exception("waiting for the copies of a failed wake failed")
        for ptr in mapped:
            try:
                self.ops.unmap_and_release(records[ptr].handle)
            except Exception:
                log.exception("releasing allocation %#x after a failed wake failed", ptr)
        log.warning("wake failed: released the %d allocations it had mapped", len(mapped))

    def _report(self, phases: Phases, **extra: Any) -> None:
        self.last[phases.kind] = phases
        body = {**phases.as_json(), "host_buffer_bytes": self.host_bytes, **extra}
        log.info("%s %s", MARKER, json.dumps(body, sort_keys=True))

    def report(self) -> dict[str, Any]:
        """The kept buffer's size and the last sleep's and wake's phases."""
        return {
            "host_buffer_bytes": self.host_bytes,
            "backups": len(self.backups),
            **{kind: p.as_json() for kind, p in self.last.items()},
        }

    def close(self) -> None:
        """Give the kept buffer back (the stage ends)."""
        if self.buffer is not None:
            self.buffer.release()
            self.buffer = None
        self.backups = {}
