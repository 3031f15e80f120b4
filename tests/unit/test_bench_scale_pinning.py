"""bench/scale_pinning.py (CPU sets of bench/scale.py's processes) and bench/scale_shards.py's
per-shard figures: the pure parts (the pinning itself needs cores to measure)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench.scale_pinning import Pinning, PinningError, parse_cpus, pin_threads
from bench.scale_probe import process_kind
from bench.scale_shards import per_shard, shards_summary
from bench.scale_storms import Fleet, by_shard

SIXTEEN = range(16)


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert parse_cpus("0-1", SIXTEEN) == {0, 1}
    assert parse_cpus("2-15", SIXTEEN) == set(range(2, 16))
    assert parse_cpus("0,2,4-5", SIXTEEN) == {0, 2, 4, 5}
    assert parse_cpus(" 3 ", SIXTEEN) == {3}


@pytest.mark.parametrize("text", ["", "a", "1-", "3-1", "-1", "0,,1", "0-1-2"])
def test_a_malformed_cpu_list_is_refused(text: str) -> None:
    with pytest.raises(PinningError):
        parse_cpus(text, SIXTEEN)


def test_cpus_the_process_may_not_use_are_refused() -> None:
    with pytest.raises(PinningError, match=r"\[16, 17\]"):
        parse_cpus("14-17", SIXTEEN)
    usable = sorted(os.sched_getaffinity(0))
    assert parse_cpus(str(usable[0])) == {usable[0]}  # default: this process's own set


def test_each_process_kind_goes_to_its_part() -> None:
    pinning = Pinning.parse("0-1", "0-1", "2-15", SIXTEEN)
    assert pinning.active
    kinds = {
        "kube-apiserver": ["/x/kube-apiserver", "--etcd-servers=..."],
        "etcd": ["/cache/etcd", "--data-dir", "d"],
        "kube-scheduler": ["/x/kube-scheduler"],
        "operator": ["/v/bin/python", "/v/bin/omnistage-operator", "--namespace", "a"],
        "simhost": ["python", "-m", "tests.scale.simhost", "--port", "1"],
        "localnode": ["python", "-m", "tests.cluster.localnode", "run"],
        "kubectl": ["/x/kubectl", "get", "pods"],
    }
    got = {name: pinning.cpus_for(process_kind(argv)) for name, argv in kinds.items()}
    control = frozenset({0, 1})
    harness = frozenset(range(2, 16))
    assert got == {
        "kube-apiserver": control, "etcd": control, "kube-scheduler": control,
        "operator": control, "simhost": harness, "localnode": harness, "kubectl": harness,
    }  # fmt: skip
    assert pinning.record() == {
        "operators": [0, 1], "control_plane": [0, 1], "harness": list(range(2, 16))
    }  # fmt: skip


def test_no_flags_pin_nothing() -> None:
    pinning = Pinning.parse(None, None, None, SIXTEEN)
    assert not pinning.active
    assert pinning.cpus_for("operators") is None
    only_ops = Pinning.parse("3", None, None, SIXTEEN)
    assert only_ops.cpus_for("operators") == frozenset({3})
    assert only_ops.cpus_for("apiserver") is None and only_ops.cpus_for("simhosts") is None


def test_every_thread_of_a_process_is_moved() -> None:
    cpu = min(os.sched_getaffinity(0))
    code = "import threading, time\n"
    code += "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() "
    code += "for _ in range(3)]\nprint('up', flush=True)\ntime.sleep(30)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        assert pin_threads(proc.pid, frozenset({cpu})) == 4
        tids = [int(t) for t in os.listdir(f"/proc/{proc.pid}/task")]
        assert {frozenset(os.sched_getaffinity(t)) for t in tids} == {frozenset({cpu})}
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert pin_threads(proc.pid, frozenset({cpu})) == 0  # gone: nothing to move


def test_a_storms_figures_by_shard_add_each_shards_operator_cpu() -> None:
    ops: list[list[Any]] = [
        [type("Op", (), {"name": "s0-op-0"})(), type("Op", (), {"name": "s0-op-1"})()],
        [type("Op", (), {"name": "s1-op-0"})()],
    ]
    result: dict[str, Any] = {
        "operator_cpu_s_by_replica": {"s0-op-0": 4.0, "s0-op-1": 0.25, "s1-op-0": 3.5},
        "by_shard": {
            "a": {"groups": 2, "overhead_s": {"p99": 1.5}, "last_done_s": 2.0},
            "b": {"groups": 1, "overhead_s": {"p99": 0.5}, "last_done_s": 1.0},
        },
    }
    per_shard(result, ["a", "b"], ops)
    assert shards_summary({"handover": result}) == {
        "a": {"groups": 2, "overhead_p99_s": 1.5, "last_done_s": 2.0, "operator_cpu_s": 4.25},
        "b": {"groups": 1, "overhead_p99_s": 0.5, "last_done_s": 1.0, "operator_cpu_s": 3.5},
    }


def test_groups_spread_over_the_shards_namespaces_round_robin() -> None:
    fleet = Fleet(None, ["a", "b"], 5)  # type: ignore[arg-type]  # no request is made
    assert fleet.ns_of == {"g0": "a", "g1": "b", "g2": "a", "g3": "b", "g4": "a"}
    assert fleet.path_of("g3") == "/apis/omnistage.io/v1alpha1/namespaces/b/omnistages"
    assert fleet.path == "/apis/omnistage.io/v1alpha1/omnistages"  # one cluster-wide watch
    assert Fleet(None, "a", 2).path.endswith("/namespaces/a/omnistages")  # type: ignore[arg-type]
    overhead, done = [0.1, 0.2, 0.3, 0.4, 0.5], [1.0, 2.0, 3.0, 4.0, 5.0]
    got = by_shard(fleet, fleet.groups, overhead, done)["by_shard"]
    assert {
        ns: (f["groups"], f["last_done_s"], f["overhead_s"]["max"]) for ns, f in got.items()
    } == {
        "a": (3, 5.0, 0.5),
        "b": (2, 4.0, 0.4),
    }
    assert by_shard(Fleet(None, "a", 2), ["g0"], [0.1], [1.0]) == {}  # type: ignore[arg-type]
