"""Label keys and values that tie child objects to their OmniStage and colocation group.

Public API (stable):

- Keys: ``NAME_LABEL`` (``app.kubernetes.io/name``), ``INSTANCE_LABEL``
  (``app.kubernetes.io/instance``), ``MANAGED_BY_LABEL`` (``app.kubernetes.io/managed-by``),
  ``STAGE_LABEL`` (``omnistage.io/stage``), ``GROUP_LABEL`` (``omnistage.io/group``);
  ``RESERVED_LABELS`` (all of them; user template labels may not set these).
- Values: ``WORKER_NAME`` (``omnistage-worker``), ``CLAIM_NAME`` (``omnistage-gpus``),
  ``MANAGER`` (``omnistage-operator``).
- ``stage_labels(stage_name, group) -> dict[str, str]``: labels of a stage's Pod and Service.
- ``stage_selector(stage_name) -> dict[str, str]``: the Service's pod selector.
- ``group_labels(group) -> dict[str, str]``: labels of a group's ResourceClaim.
- ``selector_string(labels) -> str``: ``"k=v,k2=v2"`` for label-selector queries.
- ``group_pods_selector(group) -> str``: every worker pod of a group.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "CLAIM_NAME",
    "GROUP_LABEL",
    "INSTANCE_LABEL",
    "MANAGED_BY_LABEL",
    "MANAGER",
    "NAME_LABEL",
    "RESERVED_LABELS",
    "STAGE_LABEL",
    "WORKER_NAME",
    "group_labels",
    "group_pods_selector",
    "selector_string",
    "stage_labels",
    "stage_selector",
]

NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
STAGE_LABEL = "omnistage.io/stage"
GROUP_LABEL = "omnistage.io/group"
RESERVED_LABELS = frozenset(
    {NAME_LABEL, INSTANCE_LABEL, MANAGED_BY_LABEL, STAGE_LABEL, GROUP_LABEL}
)

WORKER_NAME = "omnistage-worker"
CLAIM_NAME = "omnistage-gpus"
MANAGER = "omnistage-operator"


def stage_labels(stage_name: str, group: str) -> dict[str, str]:
    """Labels on a stage's worker Pod and Service."""
    return {
        NAME_LABEL: WORKER_NAME,
        INSTANCE_LABEL: stage_name,
        MANAGED_BY_LABEL: MANAGER,
        STAGE_LABEL: stage_name,
        GROUP_LABEL: group,
    }


def stage_selector(stage_name: str) -> dict[str, str]:
    """The selector of a stage's Service: its worker pod only."""
    return {NAME_LABEL: WORKER_NAME, STAGE_LABEL: stage_name}


def group_labels(group: str) -> dict[str, str]:
    """Labels on a group's shared ResourceClaim."""
    return {NAME_LABEL: CLAIM_NAME, MANAGED_BY_LABEL: MANAGER, GROUP_LABEL: group}


def selector_string(labels: Mapping[str, str]) -> str:
    """Render labels as an equality-based label selector (sorted, so stable)."""
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def group_pods_selector(group: str) -> str:
    """Label selector for every worker pod of ``group``."""
    return selector_string({NAME_LABEL: WORKER_NAME, GROUP_LABEL: group})
