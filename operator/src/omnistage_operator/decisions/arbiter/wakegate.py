"""The wake gate of one plan: measured free memory per device, less what this plan's wakes take.

Pure logic used by :func:`.arbiter.plan.plan` (fails closed: no measured free memory, no wake).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from omnistage_operator.decisions.arbiter.blockers import Blocker, BlockReason
from omnistage_operator.decisions.arbiter.footprints import DeviceNeed
from omnistage_worker.quantities import format_bytes

if TYPE_CHECKING:
    from omnistage_operator.decisions.arbiter import GroupMemory

__all__ = ["WakeGate"]


def _fmt(n: int | None) -> str:
    return "unknown" if n is None else format_bytes(n)


class WakeGate:
    """The measured free memory per device, less what this round's wakes take: a wake passes
    only if it covers the stage's footprint on that device plus the margin, less starting
    pods' contexts. A refusal names the device, its free memory, the need and who holds the
    rest (``holders``)."""

    def __init__(
        self, memory: GroupMemory, margin_bytes: int, context: int, starting: list[str]
    ) -> None:
        self.capacity = memory.capacity
        self.totals = {d.uuid: d.total for d in memory.devices}
        self.margin = margin_bytes
        self.context = context
        self.starting = starting
        self.holders: Mapping[str, tuple[tuple[str, int], ...]] = {}
        self.free_left: dict[str, int] | None = None
        if memory.free is not None:
            self.free_left = (
                {d.uuid: d.free for d in memory.devices} if memory.devices else {"": memory.free}
            )

    def blockers(self, name: str, need: DeviceNeed | None, devices: Sequence[str]) -> list[Blocker]:
        """Why ``name`` may not wake now for lack of measured free memory on one of its
        ``devices`` (empty: it may)."""
        if self.free_left is None:
            msg = "the group's free device memory is not measured; no wake on a guess"
            return [Blocker(BlockReason.NOT_MEASURED, msg)]
        charge = self.context * sum(1 for n in self.starting if n != name)
        for uuid, free in sorted(self.free_left.items()):
            if uuid not in devices:
                continue
            cap = self.totals.get(uuid, self.capacity if self.capacity is not None else free)
            mine = None if need is None else need.get(uuid, 0)
            required = self.margin if mine is None else min(mine + self.margin, cap)
            if free - charge < required or (mine is None and free - charge <= 0):
                return [self._short(name, uuid, free, charge, required, mine)]
        return []

    def _short(  # noqa: PLR0917 - the figures of one refusal
        self, name: str, uuid: str, free: int, charge: int, required: int, mine: int | None
    ) -> Blocker:
        holders = tuple((n, b) for n, b in self.holders.get(uuid, ()) if n != name)
        where = f" on {uuid}" if uuid else ""
        held = ", ".join(f"{n} {_fmt(b)}" for n, b in holders)
        msg = (
            f"measured free {_fmt(free)}{where}"
            + (f" less {_fmt(charge)} of starting contexts" if charge else "")
            + f" < needed {_fmt(required)} (footprint {_fmt(mine)} + margin)"
            + (f"; held by {held}" if held else "")
        )
        return Blocker(
            BlockReason.FREE_TOO_LOW, msg, device=uuid, free=free - charge, needed=required,
            holders=holders,
        )  # fmt: skip

    def take(self, need: DeviceNeed | None, devices: Sequence[str]) -> None:
        """A wake goes out: its footprint (the whole device when unknown) is no longer free on
        its ``devices``."""
        if self.free_left is not None:
            for uuid in devices:
                if uuid in self.free_left:
                    took = self.free_left[uuid] if need is None else need.get(uuid, 0)
                    self.free_left[uuid] -= took
