"""An operator process started by a test or a bench dies with it (``OperatorProcess.spawn``).

bench/scale.py's operators (and bench/scale_memory.py's) are ``OperatorProcess``es: before, a
bench killed by SIGTERM or SIGKILL left them running on the shared machine, retrying the
vanished API server. The control plane and localnode already died with their parent
(``procs.die_with_parent``); the operators now do too. A parent process spawns through
``OperatorProcess.spawn`` (a stand-in program instead of the operator: what is checked is the
process's tie to its parent) and is killed; the child must be gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import ROOT

pytestmark = [pytest.mark.timeout(120)]

PARENT = """
import os, sys, time, types
from pathlib import Path
from tests.e2e.conftest import OperatorProcess
work = Path(sys.argv[1])
op = OperatorProcess(types.SimpleNamespace(kubeconfig=work / "kubeconfig"), "ns", work)
op.spawn([sys.executable, "-c", "import time; time.sleep(300)"], dict(os.environ))
print(op.proc.pid, flush=True)
time.sleep(300)
"""


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, not yet reaped


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_the_operator_dies_with_the_process_that_started_it(tmp_path: Path, sig: int) -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, str(tmp_path)], stdout=subprocess.PIPE, env=env, cwd=ROOT
    )
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())  # printed once spawned (the parent's imports)
        assert _alive(child)
        parent.send_signal(sig)
        parent.wait(30)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"operator {child} outlived its parent ({sig!r})"
    finally:
        parent.kill()
        parent.wait(30)
        if child and _alive(child):
            os.kill(child, signal.SIGKILL)
