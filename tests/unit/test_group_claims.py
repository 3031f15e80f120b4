"""Which pods a group claim is reserved for: the key under which a round reuses the claim's
device UUIDs instead of reading the claim again (``group_claims.claim_holders``)."""

from __future__ import annotations

from typing import Any

from omnistage_operator.k8s.group_claims import claim_holders


def _pod(uid: str, node: str | None, phase: str = "Running") -> dict[str, Any]:
    spec = {"nodeName": node} if node else {}
    return {"metadata": {"uid": uid}, "spec": spec, "status": {"phase": phase}}


def test_only_scheduled_pods_that_have_not_ended_hold_the_claim() -> None:
    pods = [
        _pod("a", "node-1"),
        _pod("b", None, "Pending"),  # not scheduled: the claim is not reserved for it yet
        _pod("c", "node-1", "Failed"),  # ended: its reservation goes
        _pod("d", "node-1", "Pending"),  # scheduled, starting
    ]
    assert claim_holders(pods) == frozenset({"a", "d"})


def test_a_new_pod_changes_the_holders() -> None:
    before = claim_holders([_pod("a", "node-1")])
    after = claim_holders([_pod("a2", "node-1")])
    assert before != after and claim_holders([]) == frozenset()
