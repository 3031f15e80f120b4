"""What the runner keeps per stage and per group, and when it lets go (``Forgetting``, mixed into
``runner.GroupRunner``), so that its memory follows the stages that exist, not every stage that
ever did (issue 24).

- A deleted stage's entries go when its delete handler is done (``forget``). A round that was
  running then may have written some again, and a stage deleted and re-created between two
  rounds would inherit the old one's: so before each round of a group, the stages its rounds
  listed that are no longer in the watch, or are there under another uid, are forgotten too
  (``left``; again before the next round while a sleep ordered to one still runs: it may have
  opened the stage's channel again).
- A group's entries (its loop, kept readings, sleep tracker, claim cache, retry time, demand
  timer, the rounds' Prometheus series) go when its loop ends with no kick pending and no stage
  of the group is left but ones being deleted (``live``), never during a round; its follow-up
  and the sleeps still running in the background (orders to deleted stages, whose pods the
  delete handler removes) are cancelled. A kick afterwards (a re-created group) starts from
  nothing. With the namespace's last group dropped, the epoch last ordered with there goes too,
  and the shard's claims are told (``NamespaceClaims.vacated``: a claim a round asked for is
  dropped a lease duration later, unless a group comes back).

Which attributes are per stage and per group, and the two rules, are pure
(``decisions.retention``); the operator exports the entry counts (``omnistage_runner_entries``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

from omnistage_operator.decisions.handover.sleep_tasks import SleepTracker
from omnistage_operator.decisions.leadership import NamespaceClaims
from omnistage_operator.decisions.retention import GROUP_MAPS, STAGE_MAPS, left, live
from omnistage_operator.k8s import metrics
from omnistage_operator.k8s.builders import claim_name
from omnistage_operator.k8s.views import GroupViews, group_of
from omnistage_operator.runtime import stage_metrics

if TYPE_CHECKING:
    from omnistage_operator.k8s.worker_channels import WorkerChannels
    from omnistage_operator.k8s.worker_client import WorkerClient
    from omnistage_operator.runtime.demand_watch import DemandWatcher
    from omnistage_operator.runtime.group_loops import _Loop

__all__ = ["Forgetting"]

log = logging.getLogger(__name__)

GroupKey = tuple[str, str]  # (namespace, group)
StageKey = tuple[str, str]  # (namespace, stage)


class Forgetting:
    """Forgetting half of ``GroupRunner`` (the attributes below are the runner's)."""

    views: GroupViews
    claims: NamespaceClaims
    claim_epochs: dict[str, int]
    channels: WorkerChannels[WorkerClient]
    demand: DemandWatcher
    _loops: dict[GroupKey, _Loop]
    _sleeps: dict[GroupKey, SleepTracker]
    _members: dict[GroupKey, dict[str, str]]  # stages its rounds listed: name -> uid
    _claims: dict[str, tuple[str, tuple[str, ...], frozenset[str]]]
    _claim_errors: set[str]

    def forget(self, namespace: str, name: str) -> None:
        """Drop the in-memory facts of a deleted stage, its channel, stream and series."""
        key = (namespace, name)
        stage_metrics.forget(namespace, name)
        for attr in STAGE_MAPS:
            held = getattr(self, attr)
            if isinstance(held, dict):
                held.pop(key, None)
            else:
                held.discard(key)
        self.demand.forget(namespace, name)
        self.channels.drop(key)

    def forget_left(self, namespace: str, group: str) -> None:
        """Before a round: forget the stages the group's rounds listed that are gone or were
        re-created (``left``)."""
        members = self._members.get((namespace, group))
        if not members:
            return
        tracker = self._sleeps.get((namespace, group))
        running = tracker.running if tracker is not None else frozenset()
        for name in left(members, lambda n: self.views.stage(namespace, n)):
            self.forget(namespace, name)
            if name not in running:  # a sleep still running may open its channel again
                del members[name]

    def listed(self, namespace: str, group: str, bodies: Iterable[Mapping[str, Any]]) -> None:
        """After a round: the stages it listed (checked by ``forget_left`` before the next)."""
        members = self._members.setdefault((namespace, group), {})
        for body in bodies:
            meta = body.get("metadata") or {}
            members[str(meta.get("name"))] = str(meta.get("uid") or "")

    def loop_ended(self, namespace: str, group: str, loop: _Loop) -> None:
        """The group's loop ended with no kick pending: drop the group when it is gone (its
        follow-up too: it polled stages that are going away, or waited out a crash back-off)."""
        bodies = self.views.stages(namespace, group)
        if live(bodies):
            return
        if loop.followup is not None:
            loop.followup.cancel()
        self.drop_group(namespace, group, bodies)

    def drop_group(
        self, namespace: str, group: str, bodies: Iterable[Mapping[str, Any]] = ()
    ) -> None:
        """Drop what is kept for the group, and for its stages that are gone or being deleted
        (``bodies``: the group's stages in the watch, all being deleted)."""
        key = (namespace, group)
        tracker = self._sleeps.pop(key, None)
        sleeps = tracker.running if tracker is not None else frozenset()
        if tracker is not None:  # sleeps of deleted stages (their pods are deleted anyway)
            tracker.cancel()
        names = set(self._members.get(key, ())) | sleeps
        names |= {str(b["metadata"]["name"]) for b in bodies}
        for name in names:
            body = self.views.stage(namespace, name)
            if body is None or group_of(body) == group:  # not re-created in another group
                self.forget(namespace, name)
        for attr in GROUP_MAPS:
            getattr(self, attr).pop(key, None)
        cache = f"{namespace}/{claim_name(group)}"
        self._claims.pop(cache, None)
        self._claim_errors.discard(cache)
        self.demand.drop_group(namespace, group)
        stage_metrics.forget_group(namespace, group, back=lambda: key in self._loops)
        log.info(
            "group %s/%s: no stage left, forgotten (sleeps cancelled: %s)",
            namespace, group, sorted(sleeps) or "none",
        )  # fmt: skip
        if not any(ns == namespace for ns, _ in [*self._loops, *self.views.groups()]):
            self.claim_epochs.pop(namespace, None)
            self.claims.vacated(namespace)

    def count_entries(self) -> None:
        """Export the entry counts (``omnistage_runner_entries``, read at each scrape: lengths
        only, so a scrape from the metrics thread never iterates a changing dict)."""

        def total(attrs: tuple[str, ...]) -> Callable[[], float]:
            return lambda: float(sum(len(getattr(self, a)) for a in attrs))

        metrics.RUNNER_ENTRIES.labels("stage").set_function(total(STAGE_MAPS))
        metrics.RUNNER_ENTRIES.labels("group").set_function(total(GROUP_MAPS))
        metrics.RUNNER_ENTRIES.labels("channel").set_function(lambda: float(len(self.channels)))
        metrics.RUNNER_ENTRIES.labels("demand").set_function(lambda: float(self.demand.entries()))
