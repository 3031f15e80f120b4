"""The UUIDs of a claim's allocated GPUs, read from the ResourceSlices of its pools only.

A node-local DRA driver (the GPU drivers) names its pool after its node, so the slices of the
allocated pools' nodes (``spec.nodeName``) hold the devices: a group's round reads its node's
slices, whatever the size of the cluster. Only when those lack a device (a driver whose pools
are not named after nodes) are the driver's every slice read.
"""

from __future__ import annotations

from typing import Any

from omnistage_operator.decisions.pods import claim_device_uuids
from omnistage_operator.k8s.kube import RESOURCE_SLICES, Kube


async def allocated_uuids(kube: Kube, claim: dict[str, Any]) -> tuple[str, ...] | None:
    """The sorted UUIDs of ``claim``'s devices, or None (not allocated, a device not found)."""
    results = ((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}
    allocated = [r for r in results.get("results") or () if r.get("driver")]
    pools = sorted({(str(r["driver"]), str(r.get("pool", ""))) for r in allocated})
    slices: list[dict[str, Any]] = []
    for driver, pool in pools:
        selector = f"spec.driver={driver},spec.nodeName={pool}"
        slices += await kube.list_cluster(RESOURCE_SLICES, field_selector=selector)
    uuids = claim_device_uuids(claim, slices)
    if uuids is not None or not pools:
        return uuids
    slices = []
    for driver in sorted({d for d, _ in pools}):
        slices += await kube.list_cluster(RESOURCE_SLICES, field_selector=f"spec.driver={driver}")
    return claim_device_uuids(claim, slices)
