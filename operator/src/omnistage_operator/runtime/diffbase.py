"""kopf's last-handled configuration: built without copying what it throws away, and kept in
this process's memory instead of an annotation on the stage.

On every watch event of an OmniStage kopf builds the body's "essence" (what its change
detection compares with the last handled one) by deep-copying the whole body, then dropping
``status`` and most of ``metadata``. A stage's status, and the ``managedFields`` its writes add,
are most of the body, and a hand-over writes status several times: that copy was the largest
single cost of the operator's CPU per hand-over (cProfile over ``bench/operator_switch.py``).
``LeanDiffBaseStorage`` hands kopf's own build a body without those parts, so the essence (and
the annotation kopf stores) is the same, built from less.

``MemoryDiffBaseStorage`` keeps that essence in memory, by the stage's uid, where kopf would
patch it into the ``last-handled-configuration`` annotation: a spec change costs no write of
the stage (a main-resource PATCH, the spec's CEL rules and the object's managedFields run again
on the API server) on top of the user's own. What the annotation gave kopf across a restart is
given up: a restarted replica has no last-handled spec, so kopf calls every stage's creation
handler (as it would its resume handler) and the handlers read what they need from status
(``handlers.stage_created``: an ask for Active that no status carries yet). An annotation left
by an older operator is removed by the first essence stored for that stage.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf
from kopf._cogs.structs import dicts

__all__ = ["LeanDiffBaseStorage", "MemoryDiffBaseStorage", "lean_body"]

# What kopf's build reads of metadata: the labels and annotations it keeps, and what its
# annotation keys are formed from (ownerReferences).
_META_READ = ("labels", "annotations", "ownerReferences")


def lean_body(body: Mapping[str, Any], extra_fields: Iterable[Any] | None = None) -> dict[str, Any]:
    """``body`` without what kopf's essence drops: ``status`` and the rest of ``metadata``
    (kept whole when an extra field names them). Shallow: nothing is copied here."""
    paths = [dicts.parse_field(f) for f in extra_fields or ()]
    if any(not path for path in paths):
        return dict(body)  # the whole body is an extra field
    tops = {path[0] for path in paths}
    lean = {k: v for k, v in body.items() if k not in ("metadata", "status") or k in tops}
    meta = body.get("metadata") or {}
    if "metadata" not in tops:
        lean["metadata"] = {k: meta[k] for k in _META_READ if k in meta}
    return lean


class LeanDiffBaseStorage(kopf.AnnotationsDiffBaseStorage):
    """kopf's annotations diff-base storage whose essence is built from ``lean_body``."""

    def build(self, *, body: Any, extra_fields: Iterable[Any] | None = None) -> Any:
        """The essence kopf would build, from the lean body."""
        fields = list(extra_fields or ())
        lean = kopf.Body(cast(Any, lean_body(body, fields)))
        return super().build(body=lean, extra_fields=fields)


class MemoryDiffBaseStorage(LeanDiffBaseStorage):
    """kopf's last-handled essence of each stage in memory (by uid), never patched."""

    def __init__(self, prefix: str, key: str) -> None:
        super().__init__(prefix=prefix, key=key)
        self._essences: dict[str, Any] = {}

    def fetch(self, *, body: Any) -> Any:
        """The essence last stored for this stage by this process (None: not seen yet)."""
        return self._essences.get(str(body.get("metadata", {}).get("uid")))

    def store(self, *, body: Any, patch: Any, essence: Any) -> None:
        """Remember ``essence`` (not for a stage being deleted: kopf tells its deletion apart
        without it, and nothing would drop it); the patch only drops an older operator's
        annotation."""
        uid = str(body.get("metadata", {}).get("uid"))
        if body.get("metadata", {}).get("deletionTimestamp"):
            self._essences.pop(uid, None)
            return
        self._essences[uid] = essence
        annotations = body.get("metadata", {}).get("annotations") or {}
        for full_key in self.make_keys(self.key, body=body):
            if full_key in annotations:
                patch.metadata.annotations[full_key] = None

    def forget(self, uid: str) -> None:
        """Drop a deleted stage's essence."""
        self._essences.pop(uid, None)

    def __len__(self) -> int:
        return len(self._essences)
