"""``omnistage-operator``: the kopf operator with a liveness endpoint and Prometheus metrics.

With leader election (the default) the process runs the ``leader.Elector`` beside kopf, on its
own thread and API connection (``election_thread``: renewals do not wait behind rounds); every
replica serves its liveness and metrics endpoints, only the Lease holder acts. On shutdown the
holder steps down (the Lease's holder is cleared) after kopf stopped, so a standby takes over at
its next try instead of waiting for the Lease to expire. With election, the leader also claims
the namespaces its shard serves (``namespace_claims``: a Lease per namespace, renewed on the
same thread and cadence), and orders workers only in those it holds.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import kopf
from prometheus_client import start_http_server

from omnistage_operator.decisions.leadership import (
    AllNamespaces,
    Leadership,
    NamespaceClaims,
    SoleWriter,
)
from omnistage_operator.decisions.namespace_claims import CLAIM_NAME
from omnistage_operator.k8s import gc_metrics, gc_policy
from omnistage_operator.k8s.claim_keeper import ClaimKeeper
from omnistage_operator.k8s.leader import Elector, KrEpochStore, KrLeaseStore, new_identity
from omnistage_operator.k8s.settings import Settings, SettingsError, parse_settings
from omnistage_operator.runtime.election_thread import ElectionThread
from omnistage_worker.jsonlog import configure_logging

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, start the metrics server and run kopf until stopped."""
    try:
        settings = parse_settings(argv)
        settings.worker_credentials()  # fail early on an empty or unreadable token file
        gc_settings = gc_policy.parse(os.environ)
    except (SettingsError, gc_policy.GcPolicyError, OSError) as exc:
        print(f"omnistage-operator: {exc}", file=sys.stderr)
        return 2
    configure_logging(sys.stdout, settings.log_level, settings.log_format)
    gc_policy.apply(gc_settings)
    os.environ["OMNISTAGE_RESYNC_INTERVAL"] = str(settings.resync_interval_s)
    os.environ["OMNISTAGE_PEERING"] = settings.peering or ""
    from omnistage_operator.runtime import handlers  # noqa: F401  (registers the kopf handlers)

    start_http_server(settings.metrics_port)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(_run(settings, gc_settings))
    return 0


async def _elector(
    settings: Settings, on_acquired: Callable[[int], None], claims: ClaimKeeper
) -> Elector:
    """The elector, built on the election thread (its kr8s client is that thread's own), and
    the shard's namespace claims bound to that client (the shard: the Lease's namespace and
    name)."""
    import kr8s.asyncio

    from omnistage_operator.k8s.kube import Kube

    api = await kr8s.asyncio.api()
    namespace = settings.lease_namespace_or(str(api.namespace or "default"))
    kube = Kube(api)
    claims.bind(f"{namespace}/{settings.lease_name}", lambda ns: KrLeaseStore(api, ns, CLAIM_NAME))

    async def event(lease: Any, reason: str, message: str, warning: bool) -> None:
        await kube.event(lease, reason=reason, message=message, warning=warning)

    return Elector(
        KrLeaseStore(api, namespace, settings.lease_name),
        new_identity(),
        settings.election_timing(),
        on_acquired=on_acquired,
        event=event,
        epochs=KrEpochStore(api, namespace, f"{settings.lease_name}-epoch"),
    )


async def _run(settings: Settings, gc_settings: gc_policy.GcPolicy) -> None:
    from omnistage_operator.runtime import handlers

    gc_metrics.install()
    operator_loop = asyncio.get_running_loop()

    def acquired(epoch: int) -> None:  # called on the election thread
        operator_loop.call_soon_threadsafe(handlers.on_acquired, epoch)

    def claim_changed(namespace: str) -> None:  # called on the election thread
        operator_loop.call_soon_threadsafe(handlers.on_claim_changed, namespace)

    election: ElectionThread | None = None
    claims: NamespaceClaims = AllNamespaces()
    if settings.leader_election:
        keeper = ClaimKeeper(
            settings.election_timing(), settings.namespaces, on_change=claim_changed
        )
        election = ElectionThread(lambda: _elector(settings, acquired, keeper), keeper)
        await asyncio.to_thread(election.start)
        claims = keeper
    leadership: Leadership = election if election is not None else SoleWriter()
    handlers.configure(settings, leadership, claims)
    gc_policy.freeze(gc_settings)  # imports, kopf's registry, the election's client: kept
    try:
        await kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=settings.peering is None,
            peering_name=settings.peering,
            liveness_endpoint=f"http://0.0.0.0:{settings.liveness_port}/healthz",
        )
    finally:
        if election is not None:
            await election.stop()


if __name__ == "__main__":
    raise SystemExit(main())
