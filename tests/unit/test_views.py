"""views.GroupViews: a group's stages and pods from the watches' indexes, with this process's
own creations seen at once and confirmed deletions hidden at once."""

from __future__ import annotations

import json
from collections.abc import Hashable
from typing import Any

from omnistage_operator.api.labels import GROUP_LABEL, STAGE_LABEL
from omnistage_operator.k8s.views import GroupViews, pod_keys, stage_keys


def _stage(name: str, group: str | None) -> dict[str, Any]:
    spec = {"colocation": {"group": group}} if group else {}
    return {"metadata": {"name": name, "namespace": "ns"}, "spec": spec}


def _pod(stage: str, group: str, uid: str) -> dict[str, Any]:
    labels = {STAGE_LABEL: stage, GROUP_LABEL: group}
    return {"metadata": {"name": f"{stage}-worker", "uid": uid, "labels": labels}}


def _index(
    bodies: list[dict[str, Any]], keys: Any, namespace: str = "ns"
) -> dict[Hashable, list[dict[str, Any]]]:
    """What kopf's index holds for ``bodies`` under ``keys`` (the indexing function)."""
    out: dict[Hashable, list[dict[str, Any]]] = {}
    for body in bodies:
        for key, value in (keys(body, namespace) or {}).items():
            out.setdefault(key, []).append(value)
    return out


def test_a_group_reads_only_its_own_stages_and_pods() -> None:
    stages = [_stage("a", "g1"), _stage("b", "g1"), _stage("c", "g2"), _stage("x", None)]
    pods = [_pod("a", "g1", "ua"), _pod("c", "g2", "uc"), _pod("gone", "g1", "uo")]
    views = GroupViews(_index(stages, stage_keys), _index(pods, pod_keys))
    assert sorted(s["metadata"]["name"] for s in views.stages("ns", "g1")) == ["a", "b"]
    assert views.stages("other-ns", "g1") == []
    # The group's stages' pods and any pod labelled with the group (an orphan to fence).
    assert sorted(p["metadata"]["uid"] for p in views.pods("ns", "g1", ["a", "b"])) == ["ua", "uo"]
    assert views.stage("ns", "c") is not None and views.stage("ns", "zz") is None


def test_a_stages_pod_of_another_group_is_read_by_its_stage() -> None:
    # A stage re-created in another group: its old pod (old group label) is still its pod.
    pods = [_pod("a", "old", "u1")]
    views = GroupViews({}, _index(pods, pod_keys))
    assert [p["metadata"]["uid"] for p in views.pods("ns", "new", ["a"])] == ["u1"]


def test_created_pods_are_seen_before_the_watch_and_gone_ones_never_again() -> None:
    pods_index: dict[Hashable, list[dict[str, Any]]] = {}
    views = GroupViews({}, pods_index)
    views.created("ns", "a", _pod("a", "g1", "u1"))
    assert [p["metadata"]["uid"] for p in views.pods("ns", "g1", ["a"])] == ["u1"]
    assert views.pods("ns", "g1", ["b"]) == []  # another stage's view is untouched
    # The watch delivers it: one pod, the watched one.
    pods_index.update(_index([_pod("a", "g1", "u1")], pod_keys))
    assert [p["metadata"]["uid"] for p in views.pods("ns", "g1", ["a"])] == ["u1"]
    # Confirmed gone by the API while the watch still shows it: hidden.
    views.gone("u1")
    assert views.pods("ns", "g1", ["a"]) == []
    # Its replacement, created before the watch saw the old one go, is the stage's pod.
    views.created("ns", "a", _pod("a", "g1", "u2"))
    assert [p["metadata"]["uid"] for p in views.pods("ns", "g1", ["a"])] == ["u2"]


def test_index_entries_are_plain_copies() -> None:
    body = _stage("a", "g1")
    entry = stage_keys(body, "ns")
    assert entry is not None
    body["spec"]["colocation"]["group"] = "changed"
    assert all(v["spec"]["colocation"]["group"] == "g1" for v in entry.values())
    assert pod_keys({"metadata": {"labels": {}}}, "ns") is None


def test_index_entries_hold_no_managed_fields() -> None:
    managed = [{"manager": "omnistage", "operation": "Update", "fieldsV1": {"f:status": {}}}]
    stage = _stage("a", "g1")
    stage["metadata"]["managedFields"] = managed
    pod = _pod("a", "g1", "u1")
    pod["metadata"]["managedFields"] = managed
    for entry in (stage_keys(stage, "ns"), pod_keys(pod, "ns")):
        assert entry is not None
        for value in entry.values():
            assert "managedFields" not in value["metadata"]
            assert value["metadata"]["name"]
    assert stage["metadata"]["managedFields"] == managed  # the watched body is left alone


def test_a_pods_entry_keeps_of_its_spec_only_where_it_was_scheduled() -> None:
    pod = _pod("a", "g1", "u1")
    pod["spec"] = {
        "nodeName": "node-0",
        "containers": [{"name": "worker", "image": "img", "env": [{"name": "A", "value": "1"}]}],
        "volumes": [{"name": "models", "hostPath": {"path": "/models"}}],
    }
    pod["status"] = {"phase": "Running", "podIP": "10.0.0.1"}
    entry = pod_keys(pod, "ns")
    assert entry is not None
    for value in entry.values():
        assert value["spec"] == {"nodeName": "node-0"}
        assert value["status"] == pod["status"] and value["metadata"]["uid"] == "u1"
    views = GroupViews({}, {})
    views.created("ns", "a", pod)
    assert views.pods("ns", "g1", ["a"])[0]["spec"] == {"nodeName": "node-0"}
    assert len(pod["spec"]) == 3  # the watched body is left alone


def test_entries_share_their_keys_and_short_strings_not_their_long_ones() -> None:
    """Each decoded body has its own copy of every key; the entries share one."""
    text = json.dumps({**_stage("a", "g1"), "status": {"phase": "Asleep", "message": "x" * 100}})
    first, second = (stage_keys(json.loads(text), "ns") for _ in range(2))
    assert first is not None and second is not None
    one, two = first[("name", "ns", "a")], second[("name", "ns", "a")]
    assert one == two
    key_one = next(k for k in one["status"] if k == "phase")
    key_two = next(k for k in two["status"] if k == "phase")
    assert key_one is key_two and one["status"]["phase"] is two["status"]["phase"]
    assert next(k for k in one["metadata"] if k == "name") is next(
        k for k in two["metadata"] if k == "name"
    )
    assert one["status"]["message"] is not two["status"]["message"]  # long: left as decoded
