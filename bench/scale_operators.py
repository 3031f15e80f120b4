"""The operator replicas of bench/scale.py: processes with their own identity and Lease."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from tests.cluster.controlplane import ControlPlane
from tests.e2e.conftest import OperatorProcess

# The operator's own election timing (lease 15 s, renew deadline 10 s): a shorter deadline
# loses the Lease on this loaded 2-core machine, where a renewal itself can take seconds.
TIMING: list[str] = []


class NamedOperator(OperatorProcess):
    """An operator replica with its own identity (``POD_NAME``) and election timing.

    ``chart``: (kubeconfig, release namespace, release full name): act as the chart's pod would,
    with its ServiceAccount's token and its Lease (so the chart's FlowSchema serves the Lease
    requests); None: the admin identity (APF exempts it) and the Lease ``omnistage-operator``
    in ``namespace``.
    """

    def __init__(
        self, cp: ControlPlane, namespace: str, workdir: Path, name: str,
        chart: tuple[Path, str, str] | None = None,
    ) -> None:  # fmt: skip
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(cp, namespace, workdir, chart[0] if chart else None)
        self.name = name
        self.extra = [*TIMING]
        if not Path(self.executable).exists():  # a GPU host's bundle: its shim on PATH
            self.executable = shutil.which("omnistage-operator") or self.executable
        self.lease = (chart[1], chart[2]) if chart else (namespace, "omnistage-operator")

    def start(self) -> None:
        env = {"POD_NAME": self.name}
        if self.lease[1] != "omnistage-operator":
            env.update(POD_NAMESPACE=self.lease[0], OMNISTAGE_LEASE_NAME=self.lease[1])
        os.environ.update(env)
        try:
            super().start()
        finally:
            for key in env:
                os.environ.pop(key, None)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None
