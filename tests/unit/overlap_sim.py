"""``handover_sim.SimPort`` with the overlapped hand-over's three calls
(``handover.overlap.OverlapPort``) on the simulated device's physics: a streamed sleep gives its
weights back piece by piece after its device's free memory measured first (a liar says so and
keeps them; one draining requests the readings did not show gives no room and its stream is
cut off by the deadline, its sleep going on to be joined by task id; every other fault is the
plain sleep's), and a wake under a claim limit takes a
piece only when its limit allows it and the device has it, else it is out of memory and back
asleep, as a worker is. A wake left waiting for a raise that never comes gives up (the worker's
claim wait) and is back asleep."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import replace

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, DeviceFigures, RoomBeside, WorkerReport
from omnistage_operator.decisions.handover import WorkerRefused, WorkerUnavailable
from tests.unit.handover_sim import CONTEXT, UNIT, UUID, SimPort, SimWorker, SimWorld

PIECE = UNIT // 4
CLOCK = itertools.count(1)  # the workers' clock: each ACK's end, in order
CLAIM_WAIT_S = 0.2  # the worker's claim wait, scaled down


class OverlapSimPort(SimPort):
    """``SimPort`` with ``OverlapPort``'s calls, on the simulated device's physics."""

    def __init__(self, world: SimWorld) -> None:
        super().__init__(world)
        self.limits: dict[str, int] = {}
        self.raises: list[int] = []
        self.raised = asyncio.Event()
        self.wake_began_before_ack = False
        self.sleep_acked = False
        self.peak = 0  # the most the device held at once (its reserve included)
        self.draining: dict[str, str] = {}  # stage -> the streamed sleep still draining
        self.handoff = False  # the workers say they hand pieces over (GetStatus.handoff)
        self.channels: list[tuple[str, str]] = []  # (call, hand-off channel) as ordered

    def _report(self, wk: SimWorker) -> WorkerReport:
        """As ``SimPort``'s, from a worker that says it can take part (``claim_limits``)."""
        return replace(super()._report(wk), claim_limits=True, handoff=self.handoff)

    async def sleep_stream(
        self, stage: str, level: int, task_id: str, *, timeout_s: float, handoff_channel: str = ""
    ) -> AsyncIterator[int | RoomBeside | AckFacts]:
        """Whole-model sleep, streamed: an honest one releases piece by piece, a liar reports
        the pieces and keeps them; every other outcome is the plain sleep's (one ACK, or its
        error)."""
        self.channels.append(("sleep", handoff_channel))
        wk = self._check(stage)
        outcome = self.world.outcomes[0] if self.world.outcomes else "ok"
        if outcome not in ("ok", "lie", "drain") or wk.state is not WorkerPhase.ACTIVE:
            yield await self.sleep(stage, level, task_id)
            return
        self.world.outcomes[:1] = []
        self.calls.append(("sleep", stage))
        self.unresolved.add(stage)
        if outcome == "drain":  # a request came after the readings: the worker drains it first
            wk.state, wk.inflight = WorkerPhase.SLEEPING, 1
            self.draining[stage] = task_id
            yield 0  # its first report: nothing released, and no room while requests run
            raise WorkerUnavailable(f"SleepStream {task_id}: deadline exceeded (draining)")
        before, free_before = wk.used, self.world.free()
        yield RoomBeside(free_before)  # measured before anything is released, as a worker does
        released = 0
        while released < before - CONTEXT:
            piece = min(PIECE, before - CONTEXT - released)
            released += piece
            if outcome == "ok":  # a liar says so but keeps the memory
                wk.used -= piece
            await asyncio.sleep(0)
            yield released
        wk.state, wk.level, wk.lied = WorkerPhase.ASLEEP, level, outcome == "lie"
        self.sleep_acked = True
        ack = self._ack(
            wk, task_id, True, before, free_before, level=level, freed_bytes=released,
            finished_at=float(next(CLOCK)),
        )  # fmt: skip
        if wk.lied:  # its own figures say it holds its context; the device's free memory is real
            dev = replace(ack.devices[0], used_after=CONTEXT)
            ack = replace(ack, used_after_bytes=CONTEXT, devices=(dev,))
            wk.acks[task_id] = wk.last_ack = ack
        else:
            self.unresolved.discard(stage)
        yield ack

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
        """A ``Sleep`` of a streamed sleep still draining joins it: the drain ends, the sleep
        releases everything and its Ack (drain timed, ``replayed``) answers; else the plain
        sleep's."""
        if self.draining.get(stage) != task_id:
            return await super().sleep(
                stage, level, task_id, drain_timeout_s=drain_timeout_s, timeout_s=timeout_s,
                components=components,
            )  # fmt: skip
        del self.draining[stage]
        self.calls.append(("sleep", stage))
        wk = self._check(stage)
        before, free_before = wk.used, self.world.free()
        wk.inflight, wk.used, wk.state, wk.level = 0, CONTEXT, WorkerPhase.ASLEEP, level
        self.sleep_acked = True
        self.unresolved.discard(stage)
        return self._ack(
            wk, task_id, True, before, free_before, level=level, freed_bytes=before - CONTEXT,
            drain_s=1.5, replayed=True, finished_at=float(next(CLOCK)),
        )  # fmt: skip

    async def wake_limited(
        self, stage: str, task_id: str, claim_limit_bytes: int, handoff_channel: str = ""
    ) -> AckFacts:
        """Take the weights piece by piece under the limit, each only if the device has it (a
        piece handed over is one the sleep released: the device's total is the same)."""
        self.calls.append(("wake", stage))
        self.channels.append(("wake", handoff_channel))
        wk = self._check(stage)
        self.wake_began_before_ack = not self.sleep_acked
        self.limits[task_id] = max(claim_limit_bytes, self.limits.get(task_id, 0))
        if task_id in wk.acks:
            return wk.acks[task_id]
        if wk.state is not WorkerPhase.ASLEEP:
            raise WorkerRefused("FAILED_PRECONDITION", f"worker is {wk.state.value}")
        before, free_before = wk.used, self.world.free()
        wk.state = WorkerPhase.WAKING
        taken = 0
        try:
            while taken < wk.weights:
                piece = min(PIECE, wk.weights - taken)
                while wk.used + piece > self.limits[task_id]:
                    self.raised.clear()
                    try:
                        await asyncio.wait_for(self.raised.wait(), CLAIM_WAIT_S)
                    except TimeoutError:
                        why = "claim limit left no room"
                        return self._woke(wk, task_id, before, free_before, why)
                if piece > self.world.free():  # the device refuses it: out of memory
                    why = "out of memory"
                    return self._woke(wk, task_id, before, free_before, why, short=piece)
                wk.used += piece
                taken += piece
                self.peak = max(self.peak, self.world.capacity - self.world.free())
                assert self.world.free() >= 0, "the device never holds more than it has"
                await asyncio.sleep(0)
        except asyncio.CancelledError:  # the round ended first: the worker gives up its wait
            wk.used, wk.state = CONTEXT, WorkerPhase.ASLEEP
            raise
        wk.state = WorkerPhase.ACTIVE
        wk.measured_fp = wk.measured_peak = wk.used
        return self._woke(wk, task_id, before, free_before, "")

    def _woke(
        self,
        wk: SimWorker,
        task_id: str,
        before: int,
        free_before: int,
        error: str,
        *,
        short: int = 0,
    ) -> AckFacts:
        if error:  # back asleep: what the wake took is freed
            wk.used, wk.state = CONTEXT, WorkerPhase.ASLEEP
        free = self.world.free()
        dev = DeviceFigures(UUID, 0, self.world.capacity, before, wk.used, free_before, free)
        ack = AckFacts(
            task_id, not error, "wake", wk.state, error=error, devices=(dev,),
            used_before_bytes=before, used_after_bytes=wk.used, free_before_bytes=free_before,
            free_after_bytes=free, total_bytes=self.world.capacity, needed_bytes=short,
            finished_at=float(next(CLOCK)),
        )  # fmt: skip
        wk.acks[task_id] = ack
        return ack

    async def raise_claim_limit(self, stage: str, task_id: str, claim_limit_bytes: int) -> None:
        self.raises.append(claim_limit_bytes)
        self.limits[task_id] = max(claim_limit_bytes, self.limits.get(task_id, 0))
        self.raised.set()
