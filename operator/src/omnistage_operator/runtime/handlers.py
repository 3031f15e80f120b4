"""Thin kopf handlers: they record asks and kick the group's hand-over loop (runner.GroupRunner).

Two kopf indexes (``omnistages_by_group``, ``worker_pods``) keep the groups' stages and worker
pods as the watches see them; rounds read them through ``views.GroupViews`` instead of listing
the namespace (kopf fills the indexes before any handler runs). Every group is resynced once per
``--resync-interval`` by one loop over that index (``resync.Resync``), not by a kopf timer per
stage (kopf would keep each stage's last raw body for it), except under kopf peering.

The runner is set by ``cli.main`` before kopf starts (``configure``). Every decision is made in
the round, which first reads every worker's real state (GetStatus), so a resumed operator never
acts on what it remembered.

Every replica runs kopf, but only the leader (``leadership.leading()``) acts:

- kicks are harmless everywhere: the runner runs no round and sends no order unless leading,
  but it remembers the group, so a replica that acquires the Lease kicks every group it has
  seen (``on_acquired``), and the first round reads the workers' real state, as on resume;
- an ask for Active is recorded in memory by every replica (a standby that takes over knows
  it); the leader's round publishes it (``status.requestedActiveAt``). kopf keeps what it last
  handled in each replica's memory (``diffbase.MemoryDiffBaseStorage``), not in an annotation:
  a spec change costs no write of the stage besides the user's own. A replica that starts
  finds the changes it missed in status: a stage that wants Active while its status (written
  before) carries no ask asked while no operator saw it, and asks now (``stage_created``);
- deletion: a standby's delete handler raises ``kopf.TemporaryError`` (it never deletes pods
  or lets kopf remove the finalizer), so the finalizer stays until the leader's handler ran.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import kopf

from omnistage_operator.api.labels import GROUP_LABEL, MANAGED_BY_LABEL, MANAGER
from omnistage_operator.api.pipelines import PIPELINE_PLURAL, pipeline_keys
from omnistage_operator.api.spec import GROUP, PLURAL, VERSION
from omnistage_operator.decisions.leadership import (
    AllNamespaces,
    Leadership,
    NamespaceClaims,
    SoleWriter,
)
from omnistage_operator.k8s.kube import Kube
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews, group_of, pod_keys, stage_keys
from omnistage_operator.runtime import login  # registers kopf's login handlers
from omnistage_operator.runtime.diffbase import MemoryDiffBaseStorage
from omnistage_operator.runtime.resync import Resync
from omnistage_operator.runtime.runner import GroupRunner

__all__ = ["configure"]

log = logging.getLogger(__name__)

FINALIZER = "omnistage.io/finalizer"
# Fixed when kopf registers the handlers: cli.main exports --resync-interval and --peering
# into these variables before importing this module.
RESYNC_S = float(os.environ.get("OMNISTAGE_RESYNC_INTERVAL", "10") or 10)
# Under kopf peering, resync rounds run on a kopf timer per OmniStage (kopf pauses it with the
# operator while another instance of the peering acts); otherwise one loop over the stages'
# index runs them (``resync.Resync``), so kopf keeps no raw body and no task per stage.
KOPF_PEERING = bool(os.environ.get("OMNISTAGE_PEERING"))
# How long a spec handler waits for the round its change kicked.
HANDOVER_WAIT_S = 5.0
# kopf's last-handled spec of each stage, in this process's memory (no annotation patch).
DIFFBASE = MemoryDiffBaseStorage(prefix="omnistage.io", key="last-handled-configuration")


class _State:
    settings: Settings | None = None
    runner: GroupRunner | None = None
    resync: Resync | None = None
    leadership: Leadership = SoleWriter()
    claims: NamespaceClaims = AllNamespaces()
    led_epoch: int | None = None  # the epoch this replica last acquired the Lease with


def configure(
    settings: Settings,
    leadership: Leadership | None = None,
    claims: NamespaceClaims | None = None,
) -> None:
    """Give the handlers their settings, leadership and the shard's namespace claims (call
    before kopf starts)."""
    _State.settings = settings
    login.configure(settings.namespaces)
    _State.leadership = leadership or SoleWriter()
    _State.claims = claims or AllNamespaces()
    _State.led_epoch = None


def on_acquired(epoch: int) -> None:
    """Leadership acquired: kick every group seen; each round reads the workers' real state
    first. Under a new epoch, first forget what status this replica last wrote and the
    workers' readings it kept (another leader may have acted since); the Lease taken back with
    the epoch this replica last led with was held by nobody else in between (every other
    holder raises it), so what it wrote stands: no round writes every stage's status again."""
    runner = _State.runner
    if runner is None:
        return  # kopf not started yet: its resume handlers kick every group
    if epoch != _State.led_epoch:
        runner.published.clear()
        runner.kept.clear()
    _State.led_epoch = epoch
    log.info("leading with epoch %d: a round for every group", epoch)
    runner.kick_all()


def on_claim_changed(namespace: str) -> None:
    """The shard's claim of ``namespace`` turned held, or another shard's holder was found:
    a round for every group seen there (it runs, or writes why it waits)."""
    if _State.runner is not None:
        _State.runner.kick_namespace(namespace, "claim")


def _kick(namespace: str | None, group: str | None, cause: str = "event") -> None:
    """Kick the group's loop (``cause``: what asked, ``GroupLoops.kick``); a standby's loop
    runs no round but remembers the group."""
    if group is not None and _State.runner is not None:
        _State.runner.kick(namespace or "default", group, cause)


def _runner() -> GroupRunner:
    if _State.runner is None:
        raise kopf.TemporaryError("operator is starting", delay=1)
    return _State.runner


# The indexes are coroutines: kopf runs a plain function in a thread of its executor, a hop
# per watch event (every status write of a storm), about a sixth of the operator's CPU in a
# 200-stage hand-over storm (py-spy).
@kopf.index(GROUP, VERSION, PLURAL)
async def omnistages_by_group(body: kopf.Body, namespace: str | None, **_: Any) -> Any:
    """OmniStages by group and by name (a round reads its group's from here, not a LIST)."""
    return stage_keys(body, namespace)


@kopf.index("", "v1", "pods", labels={MANAGED_BY_LABEL: MANAGER})
async def worker_pods(body: kopf.Body, namespace: str | None, **_: Any) -> Any:
    """Worker pods by stage and by group (a round reads its group's from here, not a LIST)."""
    return pod_keys(body, namespace)


@kopf.index(GROUP, VERSION, PIPELINE_PLURAL)
async def omnipipelines_by_stage(body: kopf.Body, namespace: str | None, **_: Any) -> Any:
    """OmniPipelines by each stage they name (a round reads its stages' batch policy here)."""
    return pipeline_keys(body, namespace)


@kopf.on.event(GROUP, VERSION, PIPELINE_PLURAL)
async def pipeline_event(
    type: str | None, body: kopf.Body, namespace: str | None, **_: Any
) -> None:
    """A pipeline appeared or changed: its stages' groups re-plan (their rounds write its
    status); with none of its stages there, the leader writes that status itself. A deleted
    one's counters are dropped."""
    runner = _State.runner
    if runner is None:
        return
    ns = namespace or "default"
    if type == "DELETED":
        runner.pipeline_status.forget(ns, str(body.get("metadata", {}).get("name")))
        return
    groups = set()
    for stage in (body.get("spec") or {}).get("stages") or []:
        found = runner.views.stage(ns, str((stage or {}).get("name")))
        if found is not None and group_of(found) is not None:
            groups.add(group_of(found))
    for group in groups:
        _kick(ns, group)
    if not groups and runner.may_order(ns):
        plain = {k: body.get(k) for k in ("apiVersion", "kind", "metadata", "spec", "status")}
        await runner.pipeline_status.after_round(ns, [plain], {}, None, now=time.time())


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **kwargs: Any) -> None:
    """kopf settings: our finalizer, progress kept in omnistage.io annotations, API timeouts."""
    ours = _State.settings or Settings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="omnistage.io")
    # kopf's own essence, built without copying status, kept in memory (diffbase)
    settings.persistence.diffbase_storage = DIFFBASE
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.posting.level = logging.WARNING
    if ours.peering is None:
        settings.peering.standalone = True
    else:
        settings.peering.name = ours.peering
        settings.peering.mandatory = True
    # kopf passes its indexes by name; they are live (kopf keeps them current).
    views = GroupViews(
        kwargs["omnistages_by_group"], kwargs["worker_pods"], kwargs["omnipipelines_by_stage"]
    )
    _State.runner = GroupRunner(await Kube.connect(), ours, _State.leadership, views, _State.claims)
    if not KOPF_PEERING:
        _State.resync = Resync(views.groups, _State.runner.resync, RESYNC_S)
        _State.resync.start()
    log.info("omnistage operator started (namespaces: %s)", ",".join(ours.namespaces) or "all")


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    """Stop the resync loop, close worker channels and the API lane."""
    if _State.resync is not None:
        await _State.resync.stop()
    if _State.runner is not None:
        await _State.runner.close()
        await _State.runner.kube.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
async def stage_created(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
    """A stage appeared, or this process sees it for the first time: run its group's round.

    An ask for Active made while no operator saw it (or before the status that would carry it
    was written) is recorded now: the stage wants Active, and its status, written before, has
    no ``requestedActiveAt`` (every status written while a stage wants Active carries it). A
    stage with no status yet asks from its creation (``port_facts``)."""
    runner = _runner()
    ns = namespace or "default"
    if unrecorded_ask(body):
        log.info("%s/%s: spec.state Active with no ask in status: asked now", ns, name)
        runner.record_ask(ns, name)
    _kick(namespace, group_of(body))


def unrecorded_ask(body: Any) -> bool:
    """The stage wants Active, and its status (written before) carries no ask."""
    spec, status = body.get("spec") or {}, body.get("status") or {}
    wants = spec.get("state", "Active") == "Active"
    written = status.get("observedGeneration") is not None
    return wants and written and not status.get("requestedActiveAt")


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def stage_updated(
    body: kopf.Body, old: Any, new: Any, namespace: str | None, name: str, **_: Any
) -> None:
    """Spec changed: a new ask for Active is stamped now; the old and new groups re-plan.

    kopf keeps the change handled in memory (no write), and the round it kicked publishes the
    ask (``status.requestedActiveAt``); an operator stopped before that finds it again from
    status (``stage_created``). The leader returns once that round has ended: meanwhile kopf
    keeps the stage's watch events (the round's own status writes) and handles only the last,
    not each one beside the hand-over."""
    runner = _runner()
    ns = namespace or "default"
    old_state = (old or {}).get("state", "Active")
    new_state = (new or {}).get("state", "Active")
    if old_state != new_state:
        log.info("%s/%s: spec.state %s -> %s", ns, name, old_state, new_state)
    if new_state == "Active" and old_state != "Active":
        runner.record_ask(ns, name)
    old_group = group_of({"spec": old or {}})
    new_group = group_of(body)
    for group in {old_group, new_group} - {None}:
        _kick(ns, group)
    if _State.leadership.leading() and new_group is not None:
        await runner.settled(ns, new_group, HANDOVER_WAIT_S)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def stage_deleted(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
    """Delete the pod (until confirmed gone) and Service, the claim with the last stage.

    Only the leader cleans up; a standby keeps the finalizer (TemporaryError) until then, and
    forgets the stage (and its group, when it was the last: ``group_forget``)."""
    runner = _runner()
    DIFFBASE.forget(str(body["metadata"].get("uid")))  # kopf sees it as deleting from here on
    if not runner.may_order(namespace or "default"):
        runner.forget(namespace or "default", name)
        _kick(namespace, group_of(body))
        raise kopf.TemporaryError(
            "not the leader, or another shard holds the namespace: its leader cleans up", delay=1
        )
    await runner.cleanup_stage(body)
    _kick(namespace, group_of(body))


async def resync(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    """Re-read worker facts now and then (status stays true without events): one round per
    group per interval (the group's other stages' timers find it fresh). Under kopf peering
    only; standalone, ``resync.Resync`` does the same for every group."""
    group = group_of(body)
    if group is not None and _State.runner is not None:
        _State.runner.resync(namespace or "default", group, RESYNC_S)


if KOPF_PEERING:
    kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_S, initial_delay=min(5.0, RESYNC_S))(resync)


@kopf.on.event("", "v1", "pods", labels={MANAGED_BY_LABEL: MANAGER})
async def worker_pod_event(
    type: str | None, body: kopf.Body, namespace: str | None, **_: Any
) -> None:
    """A worker pod changed (started, became ready, failed, went away): re-plan its group."""
    group = (body.get("metadata", {}).get("labels") or {}).get(GROUP_LABEL)
    _kick(namespace, group or None, "pod")
