"""Epochs without gaps on the real API server: a re-created Lease continues above the last epoch.

The elector keeps the last granted epoch in the ConfigMap ``<lease>-epoch`` (kr8s, beside the
Lease) and writes it before it leads. Deleting the Lease (by hand, or a namespace cleanup that
missed it) must not send the epoch back to 1: every worker that obeyed a later epoch would
refuse the new leader (issue 19, item 6).
"""

from __future__ import annotations

import kr8s.asyncio
import pytest

from omnistage_operator.decisions.election import Timing
from omnistage_operator.k8s.leader import Elector, KrEpochStore, KrLeaseStore
from tests.cluster.controlplane import ControlPlane

pytestmark = pytest.mark.cluster
T = Timing(lease_duration_s=3, renew_deadline_s=2, retry_period_s=0.5)


async def test_a_recreated_lease_continues_above_the_last_epoch(
    control_plane: ControlPlane, namespace: str
) -> None:
    api = await kr8s.asyncio.api(kubeconfig=str(control_plane.kubeconfig))

    def elector(identity: str) -> Elector:
        return Elector(
            KrLeaseStore(api, namespace, "op"), identity, T,
            epochs=KrEpochStore(api, namespace, "op-epoch"),
        )  # fmt: skip

    a = elector("a")
    await a.step()
    assert a.leading() and a.epoch == 1
    await a.release()
    b = elector("b")
    await b.step()
    assert b.leading() and b.epoch == 2
    stored = control_plane.get_json("configmap", "op-epoch", namespace=namespace)
    assert stored["data"] == {"epoch": "2"}

    control_plane.kubectl("delete", "lease", "op", "-n", namespace)
    c = elector("c")
    await c.step()
    assert c.leading() and c.epoch == 3
    lease = control_plane.get_json("lease", "op", namespace=namespace)
    assert lease["spec"]["leaseTransitions"] == 3 and lease["spec"]["holderIdentity"] == "c"
    stored = control_plane.get_json("configmap", "op-epoch", namespace=namespace)
    assert stored["data"] == {"epoch": "3"}
    # A stale stored epoch (written by someone else, lower) is never lowered further.
    await KrEpochStore(api, namespace, "op-epoch").put(1)
    assert await KrEpochStore(api, namespace, "op-epoch").get() == 3
