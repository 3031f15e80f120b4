"""The periodic resync: one loop over the stages' index (``runtime.resync``) gives every group
one round per interval, as kopf's per-stage timer did, without kopf keeping a body per stage."""

from __future__ import annotations

import asyncio
import itertools
import os
import subprocess
import sys
import time
from typing import Any

import kopf
from kopf._core.engines.indexing import Index

from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews, stage_keys
from omnistage_operator.runtime import handlers
from omnistage_operator.runtime.resync import Resync
from omnistage_operator.runtime.runner import GroupRunner

INTERVAL_S = 0.5


class _Standby:
    epoch = 1

    def leading(self) -> bool:
        return False


def _stage(name: str, group: str, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"u-{name}"}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-26T00:00:00Z"
    return {"metadata": meta, "spec": {"colocation": {"group": group}}}


def _index(*bodies: dict[str, Any]) -> dict[Any, list[dict[str, Any]]]:
    """The stages' index as kopf builds it from ``stage_keys``."""
    index: dict[Any, list[dict[str, Any]]] = {}
    for body in bodies:
        for key, value in (stage_keys(body, "ns") or {}).items():
            index.setdefault(key, []).append(value)
    return index


async def _until(what: str, ok: Any, within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def test_the_index_lists_every_group_with_a_stage_not_being_deleted() -> None:
    index: Index[Any, Any] = Index()  # kopf's own, fed as its indexer does
    for body in (_stage("a", "g"), _stage("b", "g"), _stage("c", "h"), _stage("d", "gone", True)):
        meta = body["metadata"]
        index._replace(("ns", meta["name"], meta["uid"]), stage_keys(body, "ns") or {})  # type: ignore[arg-type]
    views = GroupViews(index, {})
    assert sorted(views.groups()) == [("ns", "g"), ("ns", "h")]
    index._discard(("ns", "c", "u-c"))  # type: ignore[arg-type]  # h's only stage went away
    assert sorted(views.groups()) == [("ns", "g")]


async def test_every_group_gets_one_round_per_interval_whatever_its_stage_count() -> None:
    index = _index(_stage("a", "g"), _stage("b", "g"), _stage("c", "h"), _stage("d", "x", True))
    views = GroupViews(index, {})
    runner = GroupRunner(None, Settings(), _Standby(), views)  # type: ignore[arg-type]
    rounds: dict[str, list[float]] = {}

    async def counted(namespace: str, group: str) -> bool:
        rounds.setdefault(group, []).append(time.monotonic())
        return False

    runner.round = counted  # type: ignore[method-assign]
    loop = Resync(views.groups, runner.resync, INTERVAL_S, initial_delay_s=0)
    loop.start()
    try:
        await _until("four rounds of g", lambda: len(rounds.get("g", ())) >= 4)
        times = rounds["g"]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        # one round per interval (g's two stages do not make two), never sooner than most of it
        assert all(gap >= 0.9 * INTERVAL_S - 0.02 for gap in gaps), gaps
        assert "x" not in rounds  # only a stage being deleted: no resync (as kopf's timer)
        # a group that appears is resynced; one that goes away is not any more
        index.update(_index(_stage("e", "new")))
        del index[("group", "ns", "g")]
        g_then = len(rounds["g"])
        await _until("a round of the new group", lambda: "new" in rounds)
        h_then = len(rounds["h"])
        await _until("two more rounds of h", lambda: len(rounds["h"]) >= h_then + 2)
        assert len(rounds["g"]) <= g_then + 1  # at most the step that was under way
    finally:
        await loop.stop()
        await runner.close()


def test_a_step_begins_at_most_its_share_of_rounds_and_the_next_goes_on_from_there() -> None:
    """50 groups due at once, 20 rounds a second, steps of 1 s: 20, 20, then the last 10 (and
    the first ones again only when they are due), instead of all 50 in the first step."""
    groups = [("ns", f"g{i}") for i in range(50)]
    due = set(groups)
    begun: list[tuple[str, str]] = []

    def resync(namespace: str, group: str, interval_s: float) -> bool:
        if (namespace, group) not in due:
            return False
        due.discard((namespace, group))
        begun.append((namespace, group))
        return True

    loop = Resync(lambda: groups, resync, 10.0, max_per_s=20.0)
    assert [loop.step(), loop.step(), loop.step(), loop.step()] == [20, 20, 10, 0]
    assert begun == groups  # each once, in turn
    due.update(groups[:3])  # due again: the next step begins where the last one stopped
    assert loop.step() == 3 and begun[-3:] == groups[:3]


def _spawning(module: str) -> list[str]:
    registry = kopf.get_default_registry()
    return [h.id for h in registry._spawning.get_all_handlers() if h.fn.__module__ == module]


def test_standalone_kopf_runs_no_timer_on_omnistages_so_it_keeps_no_body_per_stage() -> None:
    """kopf keeps an object's last raw body only for its timers and daemons."""
    assert not handlers.KOPF_PEERING
    assert _spawning(handlers.__name__) == []


def test_under_kopf_peering_the_resync_stays_kopfs_timer() -> None:
    """A peering instance that kopf pauses must not resync: kopf pauses its timers with it."""
    code = (
        "from omnistage_operator.runtime import handlers\n"
        "import kopf\n"
        "r = kopf.get_default_registry()._spawning.get_all_handlers()\n"
        "print([(h.id, h.interval) for h in r])\n"
    )
    env = {**os.environ, "OMNISTAGE_PEERING": "omnistage", "OMNISTAGE_RESYNC_INTERVAL": "7"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "resync" in out and "7.0" in out, out
