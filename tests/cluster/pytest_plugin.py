"""Pytest fixtures for the real local control plane and localnode GPU nodes.

Fixtures (tests using any of them are marked ``cluster`` automatically):

``control_plane`` (session): a started ``tests.cluster.controlplane.ControlPlane`` — etcd,
    kube-apiserver, kube-scheduler and kube-controller-manager of Kubernetes v1.36.3. Use
    ``control_plane.kubeconfig`` (admin, system:masters), ``.server``, ``.kubectl(...)``,
    ``.helm(...)``, ``.apply(manifest, namespace=)``, ``.get_json(...)``,
    ``.create_namespace(prefix)`` and ``.service_account_kubeconfig(ns, sa)`` (a token
    kubeconfig, to prove RBAC by running a program as that ServiceAccount).
``local_nodes`` (session): ``tests.cluster.localnode.LocalNodes`` running ONE node
    ``gpu-node-0`` with 2 fake GPUs of 80Gi each (DRA driver and DeviceClass
    ``gpu.nvidia.com``). ``local_nodes.pod_log(pod_obj, container)`` reads a container's output.
``make_local_nodes`` (function): a factory ``make_local_nodes(nodes=1, gpus=2,
    gpu_memory=80 * GiB, name_prefix=None, extra_args=(), **settings) -> LocalNodes`` for
    extra nodes (``extra_args``: more ``python -m tests.cluster.localnode`` flags; ``settings``:
    ``LocalNodes`` keywords such as ``gpu_context``, ``gpu_activation``) that exist only for
    the test (names ``<prefix>0``..; the default prefix is unique per call, e.g. ``gpu-x1-``).
    Pin pods to them with a nodeSelector on ``kubernetes.io/hostname``.
``namespace`` (function): a fresh namespace (its ``default`` ServiceAccount exists), deleted
    after the test.

When the binaries are missing the fixtures FAIL with the command to build them
(``python -m tests.cluster.build``). Timing figures (cold build from the build's record,
control-plane start and teardown, localnode start) are printed in the terminal summary.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from tests.cluster.build import BuildError, build_record, find_binaries
from tests.cluster.controlplane import ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.localnode.devices import GiB

CLUSTER_FIXTURES = {"control_plane", "local_nodes", "make_local_nodes", "namespace"}
_timings: dict[str, float] = {}
_notes: list[str] = []


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test that uses a cluster fixture with ``cluster``."""
    for item in items:
        if CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.cluster)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """Print the cluster timing figures when a control plane ran."""
    if not _timings:
        return
    terminalreporter.section("omnistage local cluster timings")
    for line in _notes:
        terminalreporter.write_line(line)
    for key, value in _timings.items():
        terminalreporter.write_line(f"{key}: {value:.1f}s")


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """The session's control plane (fails when the binaries are not built)."""
    try:
        binaries = find_binaries()
        record = build_record()
    except BuildError as exc:
        pytest.fail(f"{exc}\n(build once with: python -m tests.cluster.build)", pytrace=False)
    _notes.append(
        f"binary build (recorded {record.get('date')}): {record.get('seconds')}s, "
        f"{'cold' if record.get('cold') else 'warm'} Go cache, {record.get('cpus')} CPUs"
    )
    cp = ControlPlane(binaries=binaries)
    with cp:
        _timings["control plane start (warm binaries)"] = cp.timings["start"]
        yield cp
    _timings["control plane teardown"] = cp.timings["teardown"]


@pytest.fixture(scope="session")
def local_nodes(control_plane: ControlPlane) -> Iterator[LocalNodes]:
    """One localnode node ``gpu-node-0`` with 2 fake 80Gi GPUs, for the session."""
    with LocalNodes(control_plane.kubeconfig, nodes=1, gpus=2) as nodes:
        _timings["localnode start (1 node)"] = nodes.timings["start"]
        yield nodes


_prefixes = itertools.count(1)


@pytest.fixture
def make_local_nodes(control_plane: ControlPlane) -> Iterator[Callable[..., LocalNodes]]:
    """Factory for extra localnode nodes, stopped (their Nodes deleted) after the test."""
    started: list[LocalNodes] = []

    def make(
        nodes: int = 1,
        gpus: int = 2,
        gpu_memory: int = 80 * GiB,
        name_prefix: str | None = None,
        extra_args: Sequence[str] = (),
        **settings: Any,
    ) -> LocalNodes:
        ln = LocalNodes(
            control_plane.kubeconfig,
            nodes=nodes,
            gpus=gpus,
            gpu_memory=gpu_memory,
            name_prefix=name_prefix or f"gpu-x{next(_prefixes)}-",
            extra_args=extra_args,
            **settings,
        )
        ln.__enter__()
        started.append(ln)
        return ln

    yield make
    for ln in reversed(started):
        ln.stop()


@pytest.fixture
def namespace(control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace, deleted (without waiting) after the test."""
    name = control_plane.create_namespace("t")
    yield name
    control_plane.delete_namespace(name)
