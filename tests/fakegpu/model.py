"""Pure physics of a simulated GPU: what the driver charges, what NVML lists, when it OOMs.

A device has a ``total``, a driver ``reserve`` that is never free, and a set of processes.
Each process is charged:

- ``context``: its CUDA context, taken at its first touch, before any weight loads;
- ``weights``: its engine's device bytes (the worker's own tensor accounting);
- ``pool``: the activation blocks its caching allocator holds: a request takes ``activation``
  bytes (a fraction of the process's weights, or absolute bytes) while it runs, and the blocks
  stay in the pool after it ends, until ``release_cached`` (``empty_cache``) returns them;
- ``leaked``: bytes a sleep left behind (fault ``leak_on_sleep``), in its own figure;
- ``hidden``: leaked bytes its own figure omits (fault ``lie``): the device still holds them.

Weights that grow (a wake's or a load's copy) are an allocation like any other: when they do
not fit, :func:`copy_weights` raises the OOM (fault ``tenant_on_copy`` makes another process
take the room right before the copy: a wake the gate let through that runs out mid-copy).

``free = total - reserve - sum(charged of live processes)``; ``used`` of one process is what
NVML lists for it (``charged - hidden``). Allocations that do not fit raise :class:`OutOfMemory`
with CUDA's wording. Nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

MiB = 1024**2
GiB = 1024**3
# What NVML shows on an H100 80GB HBM3 (driver 580): total, and a process's CUDA context.
H100_TOTAL = 81559 * MiB
H100_CONTEXT = 612 * MiB
# Free memory of an idle H100 is about 0.6% below its total (driver and ECC reserve).
RESERVE_FRACTION = 0.006
ACTIVATION_FRACTION = 0.25


def default_reserve(total: int) -> int:
    """The driver reserve of a device of ``total`` bytes (0.6%, as an H100 shows)."""
    return round(total * RESERVE_FRACTION)


def default_context(total: int) -> int:
    """A process's context charge: 612 MiB on an H100, scaled to ``total``."""
    return round(H100_CONTEXT * total / H100_TOTAL)


class OutOfMemory(RuntimeError):
    """An allocation the device cannot hold; worded as PyTorch words a CUDA OOM."""

    def __init__(self, nbytes: int, device: Device, free: int, index: int = 0) -> None:
        super().__init__(
            f"CUDA out of memory. Tried to allocate {_mib(nbytes)}. GPU {index} has a total "
            f"capacity of {_mib(device.total)} of which {_mib(max(free, 0))} is free. "
            "(simulated device)"
        )
        self.nbytes = nbytes
        self.free = free


def _mib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.2f} MiB"


@dataclass(frozen=True)
class Device:
    """One simulated device (``device.json``). ``activation``: float = fraction, int = bytes."""

    uuid: str
    index: int = 0
    name: str = "Simulated GPU"
    total: int = 80 * GiB
    reserve: int = -1  # -1: default_reserve(total)
    context: int = -1  # -1: default_context(total)
    activation: float | int = ACTIVATION_FRACTION

    def __post_init__(self) -> None:
        if self.reserve < 0:
            object.__setattr__(self, "reserve", default_reserve(self.total))
        if self.context < 0:
            object.__setattr__(self, "context", default_context(self.total))
        if self.total <= 0 or self.reserve >= self.total:
            raise ValueError(f"device {self.uuid}: total {self.total}, reserve {self.reserve}")
        if self.activation < 0:
            raise ValueError(f"device {self.uuid}: negative activation {self.activation}")

    def activation_bytes(self, weights: int) -> int:
        """What one request takes on top of ``weights``."""
        if isinstance(self.activation, float):
            return int(weights * self.activation)
        return int(self.activation)

    def to_json(self) -> dict[str, Any]:
        return {
            "uuid": self.uuid,
            "index": self.index,
            "name": self.name,
            "total": self.total,
            "reserve": self.reserve,
            "context": self.context,
            "activation": self.activation,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Device:
        act = data.get("activation", ACTIVATION_FRACTION)
        return cls(
            uuid=str(data["uuid"]),
            index=int(data.get("index", 0)),
            name=str(data.get("name", "Simulated GPU")),
            total=int(data["total"]),
            reserve=int(data.get("reserve", -1)),
            context=int(data.get("context", -1)),
            activation=act if isinstance(act, float) else int(act),
        )


@dataclass(frozen=True)
class Faults:
    """Fault switches of one process. ``leak_on_sleep``: bytes, or -1 for all a sleep frees;
    ``unlisted``: NVML stops listing the process (a pid it cannot resolve), so the process's
    own figure reads 0 while the device still charges everything it holds.

    ``tenant_on_copy``: ``(pid, bytes)``: when this process next copies weights onto the device
    (a wake or a load: its weights grow), the live process ``pid`` takes ``bytes`` first, as
    another tenant would between the operator's gate and the copy (one shot: the switch is
    cleared once applied; the tenant keeps the bytes until its record is withdrawn or it dies).
    """

    leak_on_sleep: int = 0
    lie: bool = False
    slow_serving_s: float = 0.0
    unlisted: bool = False  # NVML no longer lists the process: its own figure reads 0
    tenant_on_copy: tuple[int, int] | None = None

    @classmethod
    def for_pid(cls, table: Mapping[str, Any], pid: int) -> Faults:
        """The faults of ``pid`` from a ``faults.json`` table: ``"*"`` then ``"<pid>"`` on top."""
        merged: dict[str, Any] = {}
        for key in ("*", str(pid)):
            entry = table.get(key)
            if isinstance(entry, Mapping):
                merged.update(entry)
        leak = merged.get("leak_on_sleep", 0)
        tenant = merged.get("tenant_on_copy")
        return cls(
            leak_on_sleep=-1 if leak == "all" else int(leak or 0),
            lie=bool(merged.get("lie", False)),
            slow_serving_s=float(merged.get("slow_serving_s", 0.0) or 0.0),
            unlisted=bool(merged.get("unlisted", False)),
            tenant_on_copy=(int(tenant[0]), int(tenant[1])) if tenant else None,
        )


@dataclass(frozen=True)
class Proc:
    """What the device charges one process (one record in the device directory)."""

    pid: int
    create_time: float
    context: int = 0
    weights: int = 0
    in_use: int = 0  # activation bytes of the requests running now
    pool: int = 0  # activation blocks held by the caching allocator (>= in_use)
    leaked: int = 0
    hidden: int = 0

    @property
    def charged(self) -> int:
        """Everything the device holds for this process."""
        return self.context + self.weights + self.pool + self.leaked + self.hidden

    @property
    def used(self) -> int:
        """The process's used memory as NVML lists it (a liar's hidden bytes left out)."""
        return self.charged - self.hidden

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "create_time": self.create_time,
            "context": self.context,
            "weights": self.weights,
            "in_use": self.in_use,
            "pool": self.pool,
            "leaked": self.leaked,
            "hidden": self.hidden,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Proc:
        return cls(
            pid=int(data["pid"]),
            create_time=float(data["create_time"]),
            **{
                k: int(data.get(k, 0))
                for k in ("context", "weights", "in_use", "pool", "leaked", "hidden")
            },
        )


def free(device: Device, procs: Iterable[Proc]) -> int:
    """The device's free memory with ``procs`` live (not clamped: < 0 means over-committed)."""
    return device.total - device.reserve - sum(p.charged for p in procs)


def _others(me: Proc, procs: Iterable[Proc]) -> list[Proc]:
    return [p for p in procs if p.pid != me.pid]


def grow(device: Device, me: Proc, others: Iterable[Proc], nbytes: int) -> None:
    """Raise :class:`OutOfMemory` unless ``nbytes`` more fit beside ``me`` and ``others``."""
    room = free(device, [me, *_others(me, others)])
    if nbytes > room:
        raise OutOfMemory(nbytes, device, room, device.index)


def touch(device: Device, me: Proc, others: Iterable[Proc]) -> Proc:
    """The process creates its context (idempotent)."""
    if me.context:
        return me
    grow(device, me, others, device.context)
    return replace(me, context=device.context)


def with_weights(me: Proc, weights: int) -> Proc:
    """The process's engine now holds ``weights`` device bytes."""
    return replace(me, weights=weights)


def copy_weights(device: Device, me: Proc, others: Iterable[Proc], weights: int) -> Proc:
    """The engine's device bytes become ``weights``: growing them is an allocation (a wake's or
    a load's copy) that raises :class:`OutOfMemory` when it does not fit, and then nothing of
    it is charged (the caller frees what it had copied, as after a CUDA OOM)."""
    if weights > me.weights:
        grow(device, me, others, weights - me.weights)
    return with_weights(me, weights)


def serve_begin(device: Device, me: Proc, others: Iterable[Proc]) -> tuple[Proc, int]:
    """A request starts: it takes its activations (from the pool when it has room).

    Returns the new record and the bytes taken (give them to :func:`serve_end`).
    """
    need = device.activation_bytes(me.weights)
    in_use = me.in_use + need
    if in_use > me.pool:
        grow(device, me, others, in_use - me.pool)
    return replace(me, in_use=in_use, pool=max(me.pool, in_use)), need


def serve_end(me: Proc, taken: int) -> Proc:
    """The request ended: its activation blocks go back to the pool, still charged."""
    return replace(me, in_use=max(me.in_use - taken, 0))


def release_cached(me: Proc, faults: Faults, freed_by_sleep: int) -> Proc:
    """``empty_cache`` after a sleep: the pool goes back to the driver, except a fault's leak.

    ``freed_by_sleep``: the weight bytes the sleep itself let go. Of those and the pool,
    ``leak_on_sleep`` bytes (-1: all of them) stay charged: in the process's own figure, or
    hidden from it when ``lie`` is on. Leaks accumulate over sleeps; they go when the process
    dies.
    """
    released = me.pool - me.in_use
    let_go = max(freed_by_sleep, 0) + released
    leak = let_go if faults.leak_on_sleep < 0 else min(faults.leak_on_sleep, let_go)
    me = replace(me, pool=me.in_use)
    if leak <= 0:
        return me
    if faults.lie:
        return replace(me, hidden=me.hidden + leak)
    return replace(me, leaked=me.leaked + leak)
