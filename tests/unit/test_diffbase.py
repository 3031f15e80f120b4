"""The lean diff base builds kopf's own essence of a stage, from the body without its status;
the memory diff base keeps it in memory and patches nothing (an older operator's annotation
aside)."""

from __future__ import annotations

import copy
import json
from typing import Any, cast

import kopf
import pytest

from omnistage_operator.runtime.diffbase import (
    LeanDiffBaseStorage,
    MemoryDiffBaseStorage,
    lean_body,
)

PREFIX, KEY = "omnistage.io", "last-handled-configuration"


def _stage() -> dict[str, Any]:
    handled = json.dumps({"spec": {"state": "Asleep"}}) + "\n"
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {
            "name": "sd",
            "namespace": "ns",
            "uid": "u-1",
            "resourceVersion": "42",
            "generation": 3,
            "labels": {"app": "x"},
            "annotations": {
                f"{PREFIX}/{KEY}": handled,
                f"{PREFIX}/touch-dummy": "x",
                "kubectl.kubernetes.io/last-applied-configuration": "{}",
                "team": "imaging",
            },
            "finalizers": ["omnistage.io/finalizer"],
            "managedFields": [
                {"manager": f"m{i}", "fieldsV1": {"f:status": {}}} for i in range(40)
            ],
        },
        "spec": {"state": "Active", "colocation": {"group": "g1"}, "model": {"path": "/m"}},
        "status": {
            "state": "Waking",
            "conditions": [
                {"type": f"C{i}", "status": "True", "message": "m" * 200} for i in range(8)
            ],
            "devices": [{"uuid": f"GPU-{i}", "usedBytes": i} for i in range(8)],
        },
    }


@pytest.mark.parametrize(
    "extra", [None, ["status.state"], [("metadata", "generation")], ["spec.state"]]
)
def test_the_essence_is_kopfs_own(extra: list[Any] | None) -> None:
    raw = _stage()
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=PREFIX, key=KEY)
    lean = LeanDiffBaseStorage(prefix=PREFIX, key=KEY)
    want = kopfs.build(body=kopf.Body(cast(Any, copy.deepcopy(raw))), extra_fields=extra)
    got = lean.build(body=kopf.Body(cast(Any, raw)), extra_fields=extra)
    assert got == want
    assert raw == _stage()  # the body is not changed


def test_the_lean_body_leaves_out_status_and_managed_fields() -> None:
    lean = lean_body(_stage())
    assert "status" not in lean and set(lean["metadata"]) == {"labels", "annotations"}
    assert "status" in lean_body(_stage(), ["status.state"])


def test_the_memory_diff_base_patches_nothing_and_answers_by_uid() -> None:
    raw = _stage()
    del raw["metadata"]["annotations"][f"{PREFIX}/{KEY}"]
    storage = MemoryDiffBaseStorage(prefix=PREFIX, key=KEY)
    body = kopf.Body(cast(Any, raw))
    assert storage.fetch(body=body) is None  # not seen by this process: kopf's creation
    essence = storage.build(body=body)
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=essence)
    assert not patch  # kopf sends no PATCH for it
    assert storage.fetch(body=body) == essence
    other = kopf.Body(cast(Any, {**raw, "metadata": {**raw["metadata"], "uid": "u-2"}}))
    assert storage.fetch(body=other) is None
    storage.forget("u-1")
    assert storage.fetch(body=body) is None and len(storage) == 0


def test_an_older_operators_annotation_is_removed_once_and_never_read() -> None:
    storage = MemoryDiffBaseStorage(prefix=PREFIX, key=KEY)
    body = kopf.Body(cast(Any, _stage()))
    assert storage.fetch(body=body) is None  # the annotation is not a last-handled spec here
    patch = kopf.Patch()
    storage.store(body=body, patch=patch, essence=storage.build(body=body))
    assert dict(patch) == {"metadata": {"annotations": {f"{PREFIX}/{KEY}": None}}}


def test_a_stage_being_deleted_leaves_no_essence_behind() -> None:
    raw = _stage()
    del raw["metadata"]["annotations"][f"{PREFIX}/{KEY}"]
    storage = MemoryDiffBaseStorage(prefix=PREFIX, key=KEY)
    body = kopf.Body(cast(Any, raw))
    storage.store(body=body, patch=kopf.Patch(), essence=storage.build(body=body))
    raw["metadata"]["deletionTimestamp"] = "2026-11-28T22:00:00Z"
    storage.store(body=body, patch=kopf.Patch(), essence=storage.build(body=body))
    assert len(storage) == 0
