"""The group claim behind a stage's pod (``GroupClaims``, mixed into ``runner.GroupRunner``):
which claim a pod references, and the GPU UUIDs the claim was allocated (read once per claim)
for the device-identity check.

A claim reserved for scheduled pods keeps its allocation while they exist, so while the group's
scheduled pods are the ones seen at the last read, a round takes the UUIDs from that read: no
GET of the claim on the hand-over's path.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from omnistage_operator.api.spec import PlacementMode, StageSpec
from omnistage_operator.decisions.pods import TERMINAL_PHASES
from omnistage_operator.k8s.builders import claim_name, pod_claim_name
from omnistage_operator.k8s.claim_slices import allocated_uuids
from omnistage_operator.k8s.kube import CLAIMS, Kube, KubeError
from omnistage_operator.k8s.settings import Settings

__all__ = ["GroupClaims", "claim_holders"]

log = logging.getLogger(__name__)


class GroupClaims:
    """Claim half of ``GroupRunner`` (the attributes below are the runner's)."""

    kube: Kube
    settings: Settings
    _claims: dict[str, tuple[str, tuple[str, ...], frozenset[str]]]
    _claim_errors: set[str]

    def claim_for(self, spec: StageSpec) -> str | None:
        """The group claim a stage's pod references (none in explicit placement)."""
        if self.settings.placement == "explicit" or spec.placement.mode is PlacementMode.EXPLICIT:
            return None
        return pod_claim_name(spec)

    async def claim_uuids(
        self,
        namespace: str,
        group: str,
        specs: Mapping[str, StageSpec],
        holders: frozenset[str] = frozenset(),
    ) -> tuple[str, ...] | None:
        """GPU UUIDs the group's claim was allocated (from the ResourceSlices' ``uuid``
        attribute), for the device-identity check; None without a claim (Explicit placement:
        the workers are checked against each other), before allocation, or when the API does
        not let this operator read claims and slices (the check is then skipped, logged once).

        ``holders``: uids of the group's scheduled, not ended pods (``claim_holders``); while
        they are the same non-empty set as at the last read, the claim is not read again (it is
        reserved for them, so its allocation cannot change)."""
        if not any(self.claim_for(spec) is not None for spec in specs.values()):
            return None
        name = claim_name(group)
        cache_key = f"{namespace}/{name}"
        cached = self._claims.get(cache_key)
        if cached is not None and holders and cached[2] == holders:
            return cached[1]
        try:
            claim = await self.kube.get(CLAIMS, namespace, name)
            if claim is None:
                return None
            uid = claim["metadata"].get("uid", "")
            if cached is not None and cached[0] == uid:
                self._claims[cache_key] = (uid, cached[1], holders)
                return cached[1]  # an allocation does not change while the claim lives
            uuids = await allocated_uuids(self.kube, claim)
        except KubeError as exc:
            if cache_key not in self._claim_errors:
                self._claim_errors.add(cache_key)
                log.warning("%s: device identity not checked: %s", cache_key, exc)
            return None
        if uuids is not None:
            self._claims[cache_key] = (uid, uuids, holders)
        return uuids


def claim_holders(pods: Iterable[Mapping[str, Any]]) -> frozenset[str]:
    """Uids of the pods a claim is reserved for: scheduled (``spec.nodeName``) and not ended."""
    return frozenset(
        p["metadata"]["uid"]
        for p in pods
        if (p.get("spec") or {}).get("nodeName")
        and (p.get("status") or {}).get("phase") not in TERMINAL_PHASES
    )
