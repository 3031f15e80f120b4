"""The simulated GPU across PID namespaces: the device lists host pids, as a real driver does.

A process in its own PID namespace (``unshare --pid``, as a container's) touches a simulated
GPU. With the device's host side serving (:class:`tests.fakegpu.driver.DriverServer`, as the
real node runs it) its record is keyed by its host pid and counted by a host observer; without
it the record carries the namespace's pid (1), which the host cannot match to a live process.
Needs root (``unshare``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.e2e.conftest import wait_for
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.driver import DriverServer
from tests.fakegpu.model import Device, MiB

pytestmark = [pytest.mark.node]
REPO = Path(__file__).resolve().parents[2]
CHILD = """
import sys, time
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.probe import FakeGpuProbe
probe = FakeGpuProbe(FakeGpu(sys.argv[1]))
probe.touch()
print(probe.pid, flush=True)
time.sleep(120)
"""


@pytest.fixture
def gpu(tmp_path: Path) -> FakeGpu:
    device = Device(uuid="GPU-pidns", index=0, name="Fake", total=64 * MiB, reserve=0, context=MiB)
    return FakeGpu.create(tmp_path / "gpu-0", device)


@pytest.fixture
def in_pid_namespace(gpu: FakeGpu) -> Iterator[subprocess.Popen[str]]:
    """A Python process in a new PID (and mount, for its /proc) namespace touching ``gpu``."""
    argv = [
        "unshare",
        "--pid",
        "--fork",
        "--kill-child",
        "--mount-proc",
        sys.executable,
        "-c",
        CHILD,
        str(gpu.dir),
    ]
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'worker_image' / 'src'}:{REPO / 'protos/gen/python'}"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env)
    yield proc
    proc.kill()
    proc.wait(timeout=10)


def _python_child(unshare: subprocess.Popen[str]) -> int:
    """The host pid of the Python process ``unshare --fork`` started."""
    children = psutil.Process(unshare.pid).children(recursive=True)
    return next(c.pid for c in children if "python" in c.name())


def test_a_namespaced_process_is_listed_by_its_host_pid(
    gpu: FakeGpu, in_pid_namespace: subprocess.Popen[str]
) -> None:
    with DriverServer([gpu.dir]):
        assert in_pid_namespace.stdout is not None
        own = int(in_pid_namespace.stdout.readline())  # the pid the process charges itself to
        host_pid = _python_child(in_pid_namespace)
        assert own == host_pid
        wait_for("the record counted", lambda: set(gpu.live()) == {host_pid}, 10)
        assert gpu.snapshot().used_total == MiB  # its context, seen from the host
        psutil.Process(host_pid).kill()
        # the process is gone (a killed process's memory is freed): judged on the host
        wait_for("the record dropped", lambda: not gpu.live(), 10)


def test_without_the_host_side_the_record_carries_the_namespace_pid(
    gpu: FakeGpu, in_pid_namespace: subprocess.Popen[str]
) -> None:
    assert in_pid_namespace.stdout is not None
    assert int(in_pid_namespace.stdout.readline()) == 1
    assert (gpu.procs_dir / "1.json").is_file()
    assert gpu.live() == {}  # host pid 1 is another process: the charge is lost
