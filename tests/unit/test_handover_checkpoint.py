"""The round's checkpoint (the sleep ACKs written to status) travels with the wake.

It is started before the first wake (its status built, its writes sent), but the wake does not
wait for the API to answer it, nor does the reading after the wake: one API round trip less on
the hand-over's path. The round ends only once it is written, so a later status write of the
same stage (the round's publish) never lands first.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from omnistage_operator.decisions.facts import AckFacts
from omnistage_operator.decisions.handover import GroupObservation, RoundOutcome
from omnistage_operator.decisions.handover.rounds import run_round
from tests.unit.test_sleep_tasks import POLICY, DrainPort


@dataclass
class SlowStatusPort(DrainPort):
    """``DrainPort`` with nothing draining, whose status writes are answered only once a wake
    went out (the API server is slower than the wake)."""

    woken: asyncio.Event = field(default_factory=asyncio.Event)

    async def observe(self) -> GroupObservation:
        self.calls.append(("observe", ""))
        return await super().observe()

    async def wake(self, stage: str, task_id: str) -> AckFacts:
        ack = await super().wake(stage, task_id)
        self.woken.set()
        return ack

    async def checkpoint(self, outcome: RoundOutcome) -> None:
        await super().checkpoint(outcome)
        await self.woken.wait()  # the status writes' answer
        self.calls.append(("written", ""))


async def test_the_wake_goes_out_while_the_checkpoint_is_written() -> None:
    port = SlowStatusPort(a_inflight=0)
    port.release.set()
    ids = iter(["h1", "h2"])
    # Before: the wake waited for the checkpoint, which waits for a wake: the round hung.
    out = await asyncio.wait_for(run_round(port, POLICY, lambda: next(ids)), 3.0)
    assert sorted(s.order.stage for s in out.sleeps) == ["a", "c"]
    assert all(s.ok for s in out.sleeps) and list(out.wakes) == ["b"]
    calls = port.calls
    checkpoint = next(i for i, c in enumerate(calls) if c[0] == "checkpoint")
    assert calls.index(("sleep", "a")) < checkpoint and calls.index(("sleep", "c")) < checkpoint
    assert checkpoint < calls.index(("wake", "b")) < calls.index(("written", ""))
    assert calls[-1] == ("written", "")  # the round ended once it was written (the publish next)
