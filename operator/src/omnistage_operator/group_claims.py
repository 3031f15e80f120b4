"""The group claim behind a stage's pod (``GroupClaims``, mixed into ``runner.GroupRunner``):
which claim a pod references, and the GPU UUIDs the claim was allocated (read once per claim)
for the device-identity check.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from omnistage_operator.builders import (
    claim_name,
    pod_claim_name,
)
from omnistage_operator.claim_slices import allocated_uuids
from omnistage_operator.kube import (
    CLAIMS,
    Kube,
    KubeError,
)
from omnistage_operator.settings import Settings
from omnistage_operator.spec import PlacementMode, StageSpec

__all__ = ["GroupClaims"]

log = logging.getLogger(__name__)


class GroupClaims:
    """Claim half of ``GroupRunner`` (the attributes below are the runner's)."""

    kube: Kube
    settings: Settings
    _claims: dict[str, tuple[str, tuple[str, ...]]]
    _claim_errors: set[str]

    def claim_for(self, spec: StageSpec) -> str | None:
        """The group claim a stage's pod references (none in explicit placement)."""
        if self.settings.placement == "explicit" or spec.placement.mode is PlacementMode.EXPLICIT:
            return None
        return pod_claim_name(spec)

    async def claim_uuids(
        self, namespace: str, group: str, specs: Mapping[str, StageSpec]
    ) -> tuple[str, ...] | None:
        """GPU UUIDs the group's claim was allocated (from the ResourceSlices' ``uuid``
        attribute), for the device-identity check; None without a claim (Explicit placement:
        the workers are checked against each other), before allocation, or when the API does
        not let this operator read claims and slices (the check is then skipped, logged once)."""
        if not any(self.claim_for(spec) is not None for spec in specs.values()):
            return None
        name = claim_name(group)
        cache_key = f"{namespace}/{name}"
        try:
            claim = await self.kube.get(CLAIMS, namespace, name)
            if claim is None:
                return None
            uid = claim["metadata"].get("uid", "")
            cached = self._claims.get(cache_key)
            if cached is not None and cached[0] == uid:
                return cached[1]  # an allocation does not change while the claim lives
            uuids = await allocated_uuids(self.kube, claim)
        except KubeError as exc:
            if cache_key not in self._claim_errors:
                self._claim_errors.add(cache_key)
                log.warning("%s: device identity not checked: %s", cache_key, exc)
            return None
        if uuids is not None:
            self._claims[cache_key] = (uid, uuids)
        return uuids
