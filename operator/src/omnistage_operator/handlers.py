"""Thin kopf handlers: they record asks and kick the group's hand-over loop (groups.GroupRunner).

The runner is set by ``cli.main`` before kopf starts (``configure``). Every decision is made in
the round, which first reads every worker's real state (GetStatus), so a resumed operator never
acts on what it remembered.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import kopf

from omnistage_operator.groups import GroupRunner, group_of
from omnistage_operator.kube import Kube
from omnistage_operator.labels import GROUP_LABEL, MANAGED_BY_LABEL, MANAGER
from omnistage_operator.settings import Settings
from omnistage_operator.spec import GROUP, PLURAL, VERSION

__all__ = ["configure"]

log = logging.getLogger(__name__)

FINALIZER = "omnistage.io/finalizer"
# The timer's interval is fixed when kopf registers it: cli.main exports --resync-interval
# into this variable before importing this module.
RESYNC_S = float(os.environ.get("OMNISTAGE_RESYNC_INTERVAL", "10") or 10)


class _State:
    settings: Settings | None = None
    runner: GroupRunner | None = None


def configure(settings: Settings) -> None:
    """Give the handlers their settings (call before kopf starts)."""
    _State.settings = settings


def _runner() -> GroupRunner:
    if _State.runner is None:
        raise kopf.TemporaryError("operator is starting", delay=1)
    return _State.runner


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
    """kopf settings: our finalizer, progress kept in omnistage.io annotations, API timeouts."""
    ours = _State.settings or Settings()
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="omnistage.io")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix="omnistage.io", key="last-handled-configuration"
    )
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.networking.request_timeout = 30
    settings.batching.batch_window = 0.01
    settings.posting.level = logging.WARNING
    if ours.peering is None:
        settings.peering.standalone = True
    else:
        settings.peering.name = ours.peering
        settings.peering.mandatory = True
    _State.runner = GroupRunner(await Kube.connect(), ours)
    log.info("omnistage operator started (namespaces: %s)", ",".join(ours.namespaces) or "all")


@kopf.on.cleanup()
async def cleanup(**_: Any) -> None:
    """Close worker channels."""
    if _State.runner is not None:
        await _State.runner.close()


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
async def stage_created(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
    """A stage appeared (or the operator resumed): run its group's round."""
    group = group_of(body)
    if group is not None:
        _runner().kick(namespace or "default", group)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def stage_updated(
    body: kopf.Body, old: Any, new: Any, namespace: str | None, name: str, **_: Any
) -> None:
    """Spec changed: a new ask for Active is stamped now; the old and new groups re-plan."""
    runner = _runner()
    ns = namespace or "default"
    old_state = (old or {}).get("state", "Active")
    new_state = (new or {}).get("state", "Active")
    asked = new_state == "Active" and old_state != "Active"
    if asked:
        runner.record_ask(ns, name)
    old_group = group_of({"spec": old or {}})
    new_group = group_of(body)
    for group in {old_group, new_group} - {None}:
        assert group is not None
        runner.kick(ns, group)
    if asked:
        # Persist the ask before kopf marks this change handled: an operator killed now
        # re-runs this handler, one killed later finds the ask in status.
        await runner.persist_ask(ns, name)


@kopf.on.delete(GROUP, VERSION, PLURAL)
async def stage_deleted(body: kopf.Body, namespace: str | None, name: str, **_: Any) -> None:
    """Delete the pod (until confirmed gone) and Service, the claim with the last stage."""
    runner = _runner()
    await runner.cleanup_stage(body)
    group = group_of(body)
    if group is not None:
        runner.kick(namespace or "default", group)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_S, initial_delay=min(5.0, RESYNC_S))
async def resync(body: kopf.Body, namespace: str | None, **_: Any) -> None:
    """Re-read worker facts now and then (status stays true without events)."""
    group = group_of(body)
    if group is not None and _State.runner is not None:
        _State.runner.kick(namespace or "default", group)


@kopf.on.event("", "v1", "pods", labels={MANAGED_BY_LABEL: MANAGER})
async def worker_pod_event(
    type: str | None, body: kopf.Body, namespace: str | None, **_: Any
) -> None:
    """A worker pod changed (started, became ready, failed, went away): re-plan its group."""
    group = (body.get("metadata", {}).get("labels") or {}).get(GROUP_LABEL)
    if group and _State.runner is not None:
        _State.runner.kick(namespace or "default", group)
