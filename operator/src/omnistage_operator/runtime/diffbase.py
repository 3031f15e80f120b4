"""kopf's last-handled configuration, built without copying what it throws away.

On every watch event of an OmniStage kopf builds the body's "essence" (what its change
detection compares with the last handled one) by deep-copying the whole body, then dropping
``status`` and most of ``metadata``. A stage's status, and the ``managedFields`` its writes add,
are most of the body, and a hand-over writes status several times: that copy was the largest
single cost of the operator's CPU per hand-over (cProfile over ``bench/operator_switch.py``).
``LeanDiffBaseStorage`` hands kopf's own build a body without those parts, so the essence (and
the annotation kopf stores) is the same, built from less.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, cast

import kopf
from kopf._cogs.structs import dicts

__all__ = ["LeanDiffBaseStorage", "lean_body"]

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
