"""CPU sets for bench/scale.py's processes: the operators and the control plane on cores of their
own, the harness (localnode, simulated worker hosts, the bench; they stand for hundreds of other
machines) on the rest.

The bench pins itself to the harness's set first, so every process it starts inherits it; once
the control plane (or the operators) run, :func:`apply` moves each of them, every thread of it,
to its set (threads they start later inherit their creator's set).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

from bench.scale_probe import process_kind

CONTROL_PLANE = frozenset({"apiserver", "etcd", "scheduler", "controller_manager"})


class PinningError(ValueError):
    """A CPU list that does not parse or names CPUs this process may not use."""


def parse_cpus(text: str, allowed: Iterable[int] | None = None) -> frozenset[int]:
    """``"0-1,4"`` -> {0, 1, 4} (the kernel's cpulist format); every CPU must be in ``allowed``
    (default: the CPUs this process may run on)."""
    cpus: set[int] = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            raise PinningError(f"empty item in CPU list {text!r}")
        lo, sep, hi = part.partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise PinningError(f"not a CPU list: {text!r}") from None
        if first < 0 or last < first:
            raise PinningError(f"bad range {part!r} in {text!r}")
        cpus.update(range(first, last + 1))
    usable = set(os.sched_getaffinity(0) if allowed is None else allowed)
    if missing := sorted(cpus - usable):
        raise PinningError(
            f"CPU(s) {missing} of {text!r} are not available (have {sorted(usable)})"
        )
    return frozenset(cpus)


@dataclass(frozen=True)
class Pinning:
    """Which CPUs each part may use; None: left as inherited."""

    operators: frozenset[int] | None = None
    control_plane: frozenset[int] | None = None
    harness: frozenset[int] | None = None

    @classmethod
    def parse(
        cls, operators: str | None, control_plane: str | None, harness: str | None,
        allowed: Iterable[int] | None = None,
    ) -> Pinning:  # fmt: skip
        allowed = None if allowed is None else list(allowed)

        def one(text: str | None) -> frozenset[int] | None:
            return parse_cpus(text, allowed) if text else None

        return cls(one(operators), one(control_plane), one(harness))

    @property
    def active(self) -> bool:
        return any(s is not None for s in (self.operators, self.control_plane, self.harness))

    def cpus_for(self, kind: str) -> frozenset[int] | None:
        """The set for a process of ``kind`` (``bench.scale_probe.process_kind``)."""
        if kind in CONTROL_PLANE:
            return self.control_plane
        if kind == "operators":
            return self.operators
        return self.harness

    def record(self) -> dict[str, list[int] | None]:
        """For the report: each part's CPUs."""
        parts = {"operators": self.operators, "control_plane": self.control_plane,
                 "harness": self.harness}  # fmt: skip
        return {k: sorted(v) if v is not None else None for k, v in parts.items()}


def pin_threads(pid: int, cpus: frozenset[int]) -> int:
    """Every thread of ``pid`` onto ``cpus``: how many were moved (threads may end meanwhile)."""
    moved = 0
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            moved += 1
        except OSError:
            continue
    return moved


def apply(pinning: Pinning) -> dict[str, int]:
    """This process onto the harness's set and each descendant onto its kind's set: threads
    moved, by kind."""
    if not pinning.active:
        return {}
    me = psutil.Process()
    out: dict[str, int] = {}
    if pinning.harness is not None:
        out["bench"] = pin_threads(me.pid, pinning.harness)
    for child in me.children(recursive=True):
        try:
            kind = process_kind(child.cmdline())
        except psutil.Error:
            continue
        cpus = pinning.cpus_for(kind)
        if cpus is not None:
            out[kind] = out.get(kind, 0) + pin_threads(child.pid, cpus)
    return out
