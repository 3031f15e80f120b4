"""The claim's device UUIDs come from its node's ResourceSlice alone, on the real API server.

Three localnode nodes publish a slice each; a claim allocated a device of the second node's
pool is resolved by ``allocated_uuids`` with one LIST of one slice (the field selector
``spec.driver=..,spec.nodeName=<pool>`` as the API server applies it), to that device's UUID;
a pool not named after any node falls back to the driver's every slice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from omnistage_operator.k8s.claim_slices import allocated_uuids
from omnistage_operator.k8s.kube import Kube, tallied
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.localnode.devices import DRIVER

pytestmark = [pytest.mark.timeout(300)]


def _claim(pool: str, device: str) -> dict[str, Any]:
    result = {"driver": DRIVER, "pool": pool, "device": device, "request": "gpu"}
    return {"status": {"allocation": {"devices": {"results": [result]}}}}


async def _resolve(claim: dict[str, Any]) -> tuple[tuple[str, ...] | None, int, int]:
    kube = await Kube.connect()
    with tallied() as tally:
        uuids = await allocated_uuids(kube, claim)
    return uuids, tally.requests, tally.objects


def test_a_claim_reads_its_node_slice_only(
    control_plane: ControlPlane,
    make_local_nodes: Callable[..., LocalNodes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = make_local_nodes(nodes=3, gpus=2, name_prefix="slices-")
    node = nodes.node_names[1]
    want = nodes.fake_gpu(node, "gpu-1").device().uuid
    monkeypatch.setenv("KUBECONFIG", str(control_plane.kubeconfig))
    uuids, requests, objects = asyncio.run(_resolve(_claim(node, "gpu-1")))
    assert uuids == (want,)
    assert (requests, objects) == (1, 1)  # one LIST, one slice: not every node's
    # a pool not named after a node: the node-scoped LIST finds nothing, the driver's every
    # slice is read, and a device none of them has stays unresolved
    uuids, requests, objects = asyncio.run(_resolve(_claim("not-a-node", "gpu-0")))
    assert uuids is None and requests == 2 and objects >= 3
