"""The directory a group's worker pods share on their node to hand device pieces over in an
overlapped hand-over (``--handoff-host-path``; the worker's ``OMNISTAGE_HANDOFF_DIR``)."""

from __future__ import annotations

from typing import Any

from omnistage_operator.api.spec import StageSpec

HANDOFF_VOLUME = "handoff"
HANDOFF_MOUNT_DIR = "/run/omnistage/handoff"
HANDOFF_DIR_ENV = "OMNISTAGE_HANDOFF_DIR"
"""The worker's hand-off directory (``omnistage_worker.engine.handoff``)."""


def handoff_volume(
    stage: StageSpec, host_path: str
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The mount and the volume of the directory a group's workers share on their node to hand
    device pieces over (``<host_path>/<namespace>/<group>``); None without ``host_path``."""
    if not host_path:
        return None
    path = f"{host_path.rstrip('/')}/{stage.namespace}/{stage.group}"
    return (
        {"name": HANDOFF_VOLUME, "mountPath": HANDOFF_MOUNT_DIR},
        {"name": HANDOFF_VOLUME, "hostPath": {"path": path, "type": "DirectoryOrCreate"}},
    )
