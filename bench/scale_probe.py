"""What bench/scale.py measures over a storm: the operators' counters, CPU and RSS, the API
server's request counts, where the machine's CPU went, and etcd's size."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from bench.scale_operators import NamedOperator
from tests.cluster.controlplane import ControlPlane


def counters(text: str, name: str, label: str = "group") -> dict[str, float]:
    """A counter's samples by their ``label`` (summed over other labels)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = re.search(label + r'="([^"]*)"', line)
            key = m.group(1) if m else ""
            out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


# The operator's API requests: time waiting for a request slot (by lane), time the API server
# took (all verbs).
# Counters kept by one label, each under its key in a replica's figures.
BY_LABEL = {
    # leadership changes of this replica (the only one: did it step down mid-storm?)
    "leader": ("omnistage_leader_transitions_total", "change"),
    # wall-clock and CPU seconds inside garbage collections; prometheus_client's own count
    "gc": ("omnistage_gc_seconds_total", "generation"),
    "gc_cpu": ("omnistage_gc_cpu_seconds_total", "generation"),
    "gc_n": ("python_gc_collections_total", "generation"),
    # rounds by outcome, and by what asked for them first
    "outcome": ("omnistage_rounds_total", "outcome"),
    "cause": ("omnistage_round_kicks_total", "cause"),
}

API_TIMES = {
    "api_wait": ("omnistage_api_wait_seconds", "lane"),
    "api_request": ("omnistage_api_request_seconds", "verb"),
}


def api_times(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Mean seconds per request of a storm: waiting for a slot (per lane), at the API server."""
    out: dict[str, Any] = {}
    for key in API_TIMES:
        total: dict[str, list[float]] = {}
        for name, m in after.items():
            b = before.get(name, {})
            for part in ("sum", "count"):
                for lane, v in m.get(f"{key}_{part}", {}).items():
                    got = total.setdefault(lane, [0.0, 0.0])
                    got[part == "count"] += v - b.get(f"{key}_{part}", {}).get(lane, 0.0)
        out[f"{key}_mean_s"] = {
            lane or "all": round(s / c, 3) for lane, (s, c) in sorted(total.items()) if c > 0
        }
    return out


# Where the CPU of a storm goes: this process's descendants by what they run (the rest of the
# machine's busy time is other work on it). The control plane's binaries by name (their cache
# directory's name holds "etcd"), the Python ones by module or script.
BINARIES = {
    "kube-apiserver": "apiserver",
    "etcd": "etcd",
    "kube-scheduler": "scheduler",
    "kube-controller-manager": "controller_manager",
}
SCRIPTS = (
    ("tests.scale.simhost", "simhosts"),
    ("tests.cluster.localnode", "localnode"),
    ("omnistage-operator", "operators"),
)


def process_kind(argv: list[str]) -> str:
    """What a harness process is, from its command line (``BINARIES``, ``SCRIPTS``)."""
    cmd = " ".join(argv)
    return BINARIES.get(Path(argv[0]).name if argv else "") or next(
        (k for needle, k in SCRIPTS if needle in cmd), "other_children"
    )


def stack_cpu() -> dict[str, float]:
    """CPU seconds so far: the harness's processes by kind (``bench``: this one), and the
    whole machine's busy time (``machine``; every core)."""
    me = psutil.Process()
    out = {"bench": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        try:
            kind = process_kind(child.cmdline())
            t = child.cpu_times()
        except psutil.Error:
            continue
        out[kind] = out.get(kind, 0.0) + t.user + t.system
    m = psutil.cpu_times()
    out["machine"] = sum(m) - m.idle - getattr(m, "iowait", 0.0)
    return out


def cpu_breakdown(
    before: dict[str, float], after: dict[str, float], seconds: float
) -> dict[str, Any]:
    """A storm's CPU seconds by kind, the machine's busy seconds and the share of them that was
    not the harness's (``others``: other work on a shared machine), and how busy the machine
    was. A process that ends during the storm drops out (``leader_kill``'s killed operator: its
    kind reads low, at least 0; ``operator_cpu_s`` counts the replicas alive at the end)."""
    kinds = {k: round(max(after.get(k, 0.0) - before.get(k, 0.0), 0.0), 2) for k in after}
    machine = kinds.pop("machine")
    ours = sum(kinds.values())
    cores = psutil.cpu_count() or 1
    return {
        **kinds,
        "machine_busy_s": machine,
        "others_s": round(max(machine - ours, 0.0), 2),
        "machine_busy_fraction": round(machine / max(seconds * cores, 1e-6), 3),
    }


def apiserver_requests(cp: ControlPlane) -> dict[str, float]:
    """The API server's requests so far (every client), by ``VERB resource[/subresource]``."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
        what = labels.get("resource", "") + (
            f"/{labels['subresource']}" if labels.get("subresource") else ""
        )
        key = f"{labels.get('verb', '')} {what}"
        out[key] = out.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Served:
    """The API server's answered requests (by ``VERB resource``) and CPU seconds, summed over
    the windows measured with :meth:`window`."""

    def __init__(self, cp: ControlPlane) -> None:
        self.cp = cp
        self.requests: dict[str, float] = {}
        self.cpu_s = 0.0

    def _cpu(self) -> float:
        t = psutil.Process(self.cp.pid("kube-apiserver")).cpu_times()
        return float(t.user + t.system)

    @contextmanager
    def window(self) -> Iterator[None]:
        before, cpu = apiserver_requests(self.cp), self._cpu()
        yield
        self.cpu_s += self._cpu() - cpu
        for key, value in apiserver_requests(self.cp).items():
            self.requests[key] = self.requests.get(key, 0.0) + value - before.get(key, 0.0)


class Probe:
    """Operator figures over a storm: counters, CPU, RSS (alive replicas only), and the CPU of
    every process of the harness and of the machine (``stack_cpu``)."""

    def __init__(self, ops: list[NamedOperator], cp: ControlPlane | None = None) -> None:
        self.ops = ops
        self.cp = cp

    def snapshot(self) -> dict[str, Any]:
        snap: dict[str, Any] = {"cpu": {}, "rss": {}, "metrics": {}, "stack": stack_cpu(),
                                "scrape_cpu": {}}  # fmt: skip
        snap["apiserver"] = apiserver_requests(self.cp) if self.cp is not None else {}
        for op in self.ops:
            if not op.alive or op.proc is None:
                continue
            p = psutil.Process(op.proc.pid)
            t = p.cpu_times()
            snap["cpu"][op.name] = t.user + t.system
            snap["rss"][op.name] = p.memory_info().rss
            try:
                text = op.metrics()
            except OSError:
                continue
            t = p.cpu_times()  # what this scrape cost the operator (its exposition)
            snap["scrape_cpu"][op.name] = t.user + t.system - snap["cpu"][op.name]
            figures = snap["metrics"][op.name] = {
                k: counters(text, f"omnistage_{k}_total")
                for k in ("rounds", "round_api_requests", "round_api_objects")
            }
            for key, (name, label) in BY_LABEL.items():
                figures[key] = counters(text, name, label)
            for key, (name, label) in API_TIMES.items():
                for part in ("sum", "count"):
                    by = counters(text, f"{name}_{part}", label)
                    if label == "verb":  # every verb together
                        by = {"": sum(by.values())}
                    figures[f"{key}_{part}"] = by
        return snap

    @staticmethod
    def delta(before: dict[str, Any], after: dict[str, Any], seconds: float) -> dict[str, Any]:
        names = [n for n in after["metrics"] if n in before["metrics"]]

        def summed(kind: str) -> dict[str, float]:
            out: dict[str, float] = {}
            for n in names:
                for g, v in after["metrics"][n][kind].items():
                    out[g] = out.get(g, 0.0) + v - before["metrics"][n][kind].get(g, 0.0)
            return out

        rounds, reqs, objs = (
            summed("rounds"),
            summed("round_api_requests"),
            summed("round_api_objects"),
        )
        total_rounds = sum(rounds.values())
        per_group = [objs.get(g, 0.0) / r for g, r in rounds.items() if r > 0]
        cpu = sum(after["cpu"][n] - before["cpu"].get(n, after["cpu"][n]) for n in after["cpu"])
        return {
            "rounds": int(total_rounds),
            "api_requests_per_round": round(sum(reqs.values()) / max(total_rounds, 1), 2),
            "api_objects_per_round": round(sum(objs.values()) / max(total_rounds, 1), 2),
            "api_objects_per_round_max_group": round(max(per_group, default=0.0), 2),
            "api_objects_max_group": round(max(objs.values(), default=0.0), 1),
            "api_requests_per_s": round(sum(reqs.values()) / max(seconds, 1e-6), 1),
            "api_objects_per_s": round(sum(objs.values()) / max(seconds, 1e-6), 1),
            "operator_cpu_s": round(cpu, 2),
            # the bench's own scrape of the operator's metrics at the window's start is in
            # ``operator_cpu_s`` (it reads the CPU first), the one at its end is not
            "operator_scrape_cpu_s": round(sum(before["scrape_cpu"].get(n, 0.0) for n in names), 2),
            "operator_cpu_s_by_replica": {
                n: round(after["cpu"][n] - before["cpu"].get(n, after["cpu"][n]), 2)
                for n in sorted(after["cpu"])
            },
            "leader_lost": int(summed("leader").get("lost", 0.0)),
            "rounds_by_outcome": {k: int(v) for k, v in sorted(summed("outcome").items())},
            "rounds_by_cause": {k: int(v) for k, v in sorted(summed("cause").items())},
            "operator_gc_s": {g: round(v, 2) for g, v in sorted(summed("gc").items())},
            "operator_gc_cpu_s": {g: round(v, 2) for g, v in sorted(summed("gc_cpu").items())},
            "operator_gc_collections": {g: int(v) for g, v in sorted(summed("gc_n").items())},
            "operator_rss_mib": round(max(after["rss"].values(), default=0) / 2**20, 1),
            "operator_rss_mib_total": round(sum(after["rss"].values()) / 2**20, 1),
            **api_times(
                {n: before["metrics"][n] for n in names}, {n: after["metrics"][n] for n in names}
            ),
            "cpu_s": cpu_breakdown(before["stack"], after["stack"], seconds),
            "apiserver_requests": {
                k: int(v - before["apiserver"].get(k, 0.0))
                for k, v in sorted(after["apiserver"].items())
                if v - before["apiserver"].get(k, 0.0) >= 1 and not k.startswith("WATCH")
            },
        }


def etcd_db_bytes(cp: ControlPlane) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{cp.etcd_port}/metrics", timeout=10) as r:
        text = r.read().decode()
    m = re.search(r"^etcd_mvcc_db_total_size_in_bytes (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else 0
