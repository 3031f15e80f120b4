"""The two sides of a round's port, as protocols: what the port uses of the runner that made it
(``PortHost``), and what the runner's halves read of a port (``RoundView``).

``runner.GroupRunner`` builds a ``port.KubeGroupPort`` per round and hands itself to it; the
status publisher and the demand watcher read the port back. Typed against these protocols, the
port does not import the runner, nor the publisher and the demand watcher the port, so the
imports only point down: runner -> port -> port_host (no circle, typing-only ones included).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any, Protocol

from omnistage_operator.api.spec import SpecError, StageSpec
from omnistage_operator.decisions.arbiter import StageFacts, StageIntent
from omnistage_operator.decisions.facts import AckFacts, WorkerReport
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.decisions.leadership import Leadership
from omnistage_operator.decisions.ondemand import DemandView
from omnistage_operator.decisions.peaks import StagePeaks
from omnistage_operator.decisions.pods import CrashBackoff
from omnistage_operator.decisions.remembered import Memory
from omnistage_operator.k8s.kube import Kube
from omnistage_operator.k8s.pod_hash import PodProfile
from omnistage_operator.k8s.settings import Settings
from omnistage_operator.k8s.views import GroupViews
from omnistage_operator.k8s.worker_client import WorkerClient
from omnistage_operator.k8s.worker_credentials import WorkerCredentials

__all__ = ["DemandShaper", "PortHost", "RoundView"]

StageKey = tuple[str, str]  # (namespace, stage)


class RoundView(Protocol):
    """One round of one group as the status publisher and the demand watcher read it."""

    @property
    def r(self) -> PortHost: ...

    @property
    def ns(self) -> str: ...

    @property
    def group(self) -> str: ...

    @property
    def specs(self) -> dict[str, StageSpec]: ...

    @property
    def bodies(self) -> dict[str, dict[str, Any]]: ...

    @property
    def pods(self) -> dict[str, dict[str, Any]]: ...

    @property
    def reports(self) -> dict[str, WorkerReport]: ...

    @property
    def facts(self) -> dict[str, StageFacts]: ...

    @property
    def invalid(self) -> dict[str, tuple[dict[str, Any], SpecError]]: ...

    @property
    def held_back(self) -> dict[str, float]: ...

    @property
    def wake_held(self) -> dict[str, float]: ...

    @property
    def demand(self) -> DemandView: ...

    @property
    def demand_asked(self) -> dict[str, tuple[int, float | None]]: ...

    @property
    def demand_idle(self) -> set[str]: ...

    @property
    def held_events(self) -> list[tuple[Mapping[str, Any], str, str, bool]]: ...

    def after_checkpoint(self, stage: str) -> asyncio.Future[None] | None:
        """The round's checkpoint writes a later write of ``stage`` must wait for (None:
        none)."""
        ...


class DemandShaper(Protocol):
    """The demand streams as a round uses them (``demand_watch.DemandWatcher``)."""

    def shape(
        self, port: RoundView, intents: Mapping[str, StageIntent], now: float | None = None
    ) -> DemandView: ...

    def held(self, namespace: str, name: str) -> tuple[int, float | None]: ...


class PortHost(Memory, Protocol):
    """What a port reads, changes and calls of the runner that made it (what survives rounds;
    ``Memory``: what the port reads back from a stage's status into it)."""

    @property
    def kube(self) -> Kube: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def leadership(self) -> Leadership: ...

    def may_order(self, namespace: str) -> bool:
        """Leading, and the shard holds the namespace's claim."""
        ...

    def epoch_for(self, namespace: str) -> int:
        """The epoch orders carry in ``namespace``."""
        ...

    @property
    def views(self) -> GroupViews: ...

    @property
    def credentials(self) -> WorkerCredentials: ...

    @property
    def pod_profile(self) -> PodProfile: ...

    @property
    def demand(self) -> DemandShaper: ...

    @property
    def storming(self) -> bool: ...

    # What a round learns for the next ones (see ``runner.GroupRunner.__init__``).
    @property
    def asks(self) -> dict[StageKey, float]: ...

    @property
    def created(self) -> dict[StageKey, str]: ...

    @property
    def reached(self) -> dict[StageKey, str]: ...

    @property
    def last_acks(self) -> dict[StageKey, AckFacts]: ...

    @property
    def fenced(self) -> dict[StageKey, str]: ...

    @property
    def auth_errors(self) -> dict[StageKey, str]: ...

    @property
    def fence_pending(self) -> dict[StageKey, str]: ...

    @property
    def fences_cleared(self) -> set[StageKey]: ...

    @property
    def learned(self) -> dict[StageKey, int]: ...

    @property
    def peaks(self) -> dict[StageKey, StagePeaks]: ...

    @property
    def backoffs(self) -> dict[StageKey, CrashBackoff]: ...

    @property
    def device_mismatch(self) -> dict[StageKey, str]: ...

    @property
    def deepen_refused(self) -> dict[StageKey, int]: ...

    @property
    def active_since(self) -> dict[StageKey, tuple[str, float]]: ...

    @property
    def component_problems(self) -> dict[StageKey, tuple[str, str]]: ...

    @property
    def component_refused(self) -> dict[StageKey, tuple[str, ...]]: ...

    @property
    def stage_problems(self) -> dict[StageKey, tuple[str, str]]: ...

    # Its calls.
    def emit(
        self, body: Mapping[str, Any], reason: str, message: str, *, warning: bool = False
    ) -> None: ...

    async def publish(
        self,
        port: RoundView,
        outcome: RoundOutcome,
        *,
        events: bool = True,
        stages: frozenset[str] | None = None,
    ) -> None: ...

    def client_for(
        self, namespace: str, spec: StageSpec, pod: Mapping[str, Any]
    ) -> WorkerClient | None: ...

    def claim_for(self, spec: StageSpec) -> str | None: ...

    async def claim_uuids(
        self,
        namespace: str,
        group: str,
        specs: Mapping[str, StageSpec],
        holders: frozenset[str] = frozenset(),
    ) -> tuple[str, ...] | None: ...

    async def ensure_secret(self, namespace: str) -> None: ...

    async def delete_pod(
        self, namespace: str, pod: Mapping[str, Any], *, grace_s: int | None = None
    ) -> bool: ...

    async def fence_started(self, namespace: str, name: str, reason: str) -> None: ...

    def fence_confirmed(
        self, namespace: str, name: str, body: Mapping[str, Any] | None = None
    ) -> None: ...

    def worker_exited(
        self, body: Mapping[str, Any], uid: str, message: str, now: float, spec_hash: str = ""
    ) -> None: ...
