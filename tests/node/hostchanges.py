"""What a real node changes on the host beyond its state directory, and how it is undone.

:class:`HostChanges` records the host as it was before the node started (the iptables and
ip6tables rules, the network namespaces, whether the kubelet's log-link directory existed), makes
the node's cgroups, and at teardown kills what is left of the node's processes and removes what
it added: mounts under the state directory, the CNI network namespaces, the log links, the
bridge, the iptables rules and chains, the cgroups. :meth:`HostChanges.leftovers` lists whatever
of it is still there (empty after a clean teardown). The diffs themselves are pure logic in
:mod:`tests.node.nodeconfig`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.node.nodeconfig import (
    NodeLayout,
    cgroup_mounts,
    iptables_new_tables,
    iptables_undo,
    mounts_under,
)

NETNS_DIR = Path("/run/netns")
# the kubelet's fixed directory of symlinks to container logs (podLogsDir is configurable)
CONTAINER_LOG_LINKS = Path("/var/log/containers")
IPTABLES_FAMILIES = ("iptables", "ip6tables")
NFT_FAMILIES = {"iptables": "ip", "ip6tables": "ip6"}
# Directories outside the state directory that containerd 1.7 (its shims' sockets: fixed
# /run/containerd/s), runc (its state for namespace k8s.io), libcni (its cache) and the CNI
# network namespaces make, deepest first: removed at teardown when the node made them.
HOST_DIRS = tuple(
    Path(p)
    for p in (
        "/run/containerd/s",
        "/run/containerd/runc/k8s.io",
        "/run/containerd/runc",
        "/run/containerd",
        "/var/lib/cni/results",
        "/var/lib/cni",
        str(NETNS_DIR),
    )
)


class NodeError(RuntimeError):
    """The node could not start."""


def sh(*argv: str, check: bool = True, timeout: float = 600) -> str:
    """Run a command; its stdout (NodeError when ``check`` and it fails)."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


def iptables_save(family: str) -> str | None:
    """``iptables-save`` (or ``ip6tables-save``) output (empty with no table yet, as on a
    fresh host); None when the tool is missing."""
    tool = f"{family}-save"
    return sh(tool, check=False) if shutil.which(tool) else None


def _iptables_is_nft(family: str) -> bool:
    """Whether ``family`` is the nf_tables backend (its tables can be deleted with nft)."""
    return shutil.which(family) is not None and "nf_tables" in sh(family, "-V", check=False)


def _mountinfo() -> str:
    return Path("/proc/self/mountinfo").read_text()


def _pids_naming(text: bytes) -> set[int]:
    """Processes whose command line holds ``text`` (this node's containerd socket)."""
    pids: set[int] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if text in (entry / "cmdline").read_bytes():
                    pids.add(int(entry.name))
    return pids


@dataclass
class HostChanges:
    """The host before one node started, and the node's cgroups; see the module docstring."""

    layout: NodeLayout
    iptables_before: dict[str, str] = field(default_factory=dict)
    netns_before: set[str] = field(default_factory=set)
    log_links_existed: bool = True
    dirs_before: set[Path] = field(default_factory=lambda: set(HOST_DIRS))
    cgroups: list[Path] = field(default_factory=list)

    def snapshot(self) -> None:
        """Record the host as it is now (call holding the one-node-per-machine lock)."""
        saved = {f: iptables_save(f) for f in IPTABLES_FAMILIES}
        self.iptables_before = {f: text for f, text in saved.items() if text is not None}
        self.netns_before = set(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else set()
        self.log_links_existed = CONTAINER_LOG_LINKS.is_dir()
        self.dirs_before = {d for d in HOST_DIRS if d.exists()}

    def make_cgroups(self) -> None:
        """The node's cgroup root in every cgroup v1 hierarchy (cpuset copied from the root)."""
        for hierarchy in cgroup_mounts(_mountinfo()):
            if not hierarchy.is_dir():
                continue
            path = hierarchy / self.layout.cgroup_root.lstrip("/")
            path.mkdir(exist_ok=True)
            self.cgroups.append(path)
            for knob in ("cpuset.cpus", "cpuset.mems"):
                if (path / knob).is_file():
                    (path / knob).write_text((hierarchy / knob).read_text())

    def kill_processes(self) -> None:
        """SIGKILL this node's shims (they name its socket) and its containers (its cgroups)."""
        pids: set[int] = set()
        for cgroup in self.cgroups:
            for procs in cgroup.rglob("cgroup.procs"):
                with contextlib.suppress(OSError):
                    pids.update(int(p) for p in procs.read_text().split())
        pids |= _pids_naming(str(self.layout.socket).encode())
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.1)

    def undo(self) -> None:
        """Remove the mounts, namespaces, log links, bridge, rules and cgroups the node added
        (after :meth:`kill_processes`; the state directory is the caller's)."""
        for point in mounts_under(_mountinfo(), self.layout.state):
            sh("umount", "-l", str(point), check=False)
        if NETNS_DIR.is_dir():
            for entry in set(os.listdir(NETNS_DIR)) - self.netns_before:
                if entry.startswith("cni-"):
                    sh("umount", "-l", str(NETNS_DIR / entry), check=False)
                    (NETNS_DIR / entry).unlink(missing_ok=True)
        for link in self.log_links():
            link.unlink(missing_ok=True)
        if not self.log_links_existed:
            with contextlib.suppress(OSError):
                CONTAINER_LOG_LINKS.rmdir()
        sh("ip", "link", "delete", self.layout.bridge, check=False)
        for family, before in self.iptables_before.items():
            after = iptables_save(family) or ""
            new_tables = self._removable_tables(family, before, after)
            for command in iptables_undo(before, after, skip=new_tables):
                sh(family, *command, check=False)
            for table in new_tables:
                sh("nft", "delete", "table", NFT_FAMILIES[family], table, check=False)
        self._remove_cgroups()
        for directory in HOST_DIRS:
            if directory not in self.dirs_before:
                with contextlib.suppress(OSError):
                    directory.rmdir()  # only when empty: never another runtime's state

    @staticmethod
    def _removable_tables(family: str, before: str, after: str) -> list[str]:
        """The tables the node made, when they can go whole (the nf_tables backend)."""
        if not (_iptables_is_nft(family) and shutil.which("nft")):
            return []
        return iptables_new_tables(before, after)

    def _remove_cgroups(self) -> None:
        for cgroup in self.cgroups:
            if not cgroup.is_dir():
                continue
            for directory in sorted(
                (p for p in cgroup.rglob("*") if p.is_dir()),
                key=lambda p: -len(p.parts),
            ):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                cgroup.rmdir()

    def log_links(self) -> list[Path]:
        """The kubelet's log symlinks that point into this node's state directory."""
        if not CONTAINER_LOG_LINKS.is_dir():
            return []
        state = str(self.layout.state) + "/"
        links = [p for p in CONTAINER_LOG_LINKS.iterdir() if p.is_symlink()]
        return [p for p in links if os.readlink(p).startswith(state)]

    def leftovers(self) -> list[str]:
        """What of the node is still on the machine (empty after a clean teardown)."""
        layout = self.layout
        found = [f"log link {p}" for p in self.log_links()]
        if layout.state.exists():
            found.append(f"state dir {layout.state}")
        found += [f"mount {p}" for p in mounts_under(_mountinfo(), layout.state)]
        found += [f"cgroup {c}" for c in self.cgroups if c.exists()]
        if NETNS_DIR.is_dir():
            added = set(os.listdir(NETNS_DIR)) - self.netns_before
            found += [f"netns {n}" for n in sorted(added) if n.startswith("cni-")]
        if Path(f"/sys/class/net/{layout.bridge}").exists():
            found.append(f"bridge {layout.bridge}")
        for family, before in self.iptables_before.items():
            after = iptables_save(family) or ""
            found += [f"{family} " + " ".join(c) for c in iptables_undo(before, after)]
            if _iptables_is_nft(family):
                found += [f"{family} table {t}" for t in iptables_new_tables(before, after)]
        found += [f"directory {d}" for d in HOST_DIRS if d not in self.dirs_before and d.exists()]
        found += [f"process {p}" for p in sorted(_pids_naming(str(layout.socket).encode()))]
        return found
