"""A long drain does not hold up its group (issue 19, left open): real API server, localnode with
a simulated GPU, real workers, the real operator.

``ar`` serves a request the device makes slow (fault ``slow_serving_s``) when ``sd`` is patched
Active; ``ar`` and ``c`` must both sleep first (``sd`` fits only alone). ``c``'s sleep ACK must
be in ``c``'s status while ``ar`` still drains (before, the round waited for every sleep it sent,
so nothing of the group was published or ordered until the drain ended), ``sd``'s status must
name ``ar`` as what it waits for, and ``sd`` must wake only after ``ar``'s ok ACK, with ``ar``'s
request served in full and no fence.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.e2e.conftest import Cluster, Gpu, stage_manifest, wait_for
from tests.e2e.test_handover import _worker_pid
from tests.e2e.test_physics import _generate, _operator, _reasons

pytestmark = [pytest.mark.timeout(600)]

DRAIN_S = 40.0  # the request's extra time on the device: the drain's length


def _in_state(cluster: Cluster, name: str, state: str) -> bool:
    return cluster.state(name) == state


def test_a_long_drain_holds_up_only_the_wake_it_gates(
    cluster: Cluster, namespace: str, tmp_path: Path, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    op = _operator(cluster, namespace, tmp_path, "--sleep-timeout", "5", "--ack-retries", "1")
    try:
        node = gpu.node
        cluster.apply(stage_manifest("ar", "ar", tiny_models, node, drain_timeout_s=120))
        cluster.apply(stage_manifest("c", "ar", tiny_models, node))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, node, state="Asleep"))
        for name, state in (("ar", "Active"), ("c", "Active"), ("sd", "Asleep")):
            wait_for(f"{name} {state}", partial(_in_state, cluster, name, state), 240)
        uid = (cluster.pod("ar") or {})["metadata"]["uid"]
        gpu.nodes.device_faults(gpu.node, gpu.device, pid=_worker_pid(cluster, "ar"),
                                slow_serving_s=DRAIN_S)  # fmt: skip
        result: dict[str, Any] = {}

        def serve() -> None:
            try:
                result["response"] = _generate(cluster, "ar", timeout=DRAIN_S + 60)
            except grpc.RpcError as exc:  # pragma: no cover - reported below
                result["error"] = exc

        client = threading.Thread(target=serve, daemon=True)
        client.start()
        wait_for(
            "the request in flight",
            lambda: (r := cluster.worker_status("ar")) is not None and r.inflight_requests > 0,
            30,
        )
        sent = time.monotonic()
        cluster.patch_state("sd", "Active")

        def c_asleep_in_status() -> bool:
            st = cluster.status("c")
            ack = st.get("lastAck") or {}
            # (c still wants Active: Waiting, behind sd)
            asleep = st.get("state") in ("Asleep", "Waiting")
            return asleep and ack.get("op") == "sleep" and bool(ack["ok"])

        wait_for("c's sleep ACK in its status", c_asleep_in_status, DRAIN_S - 10)
        took = time.monotonic() - sent
        ar = cluster.worker_status("ar")
        assert ar is not None and ar.inflight_requests > 0, "ar's drain is already over"
        assert ar.phase.value == "Sleeping"
        assert "response" not in result
        # sd's status says what it waits for while ar drains (published by a later round)
        wait_for(
            "sd waiting for ar",
            lambda: "ar" in " ".join(cluster.status("sd").get("waitingFor") or ()),
            DRAIN_S - 10 - took,
        )
        assert cluster.state("sd") != "Active"
        # The drain ends: the hand-over completes behind ar's ok ACK.
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", DRAIN_S + 120)
        client.join(60)
        assert "error" not in result and result.get("response") is not None  # served in full
        assert "Fenced" not in _reasons(cluster, "ar")
        assert (cluster.pod("ar") or {})["metadata"]["uid"] == uid
        slept = cluster.worker_status("ar")
        woke = cluster.worker_status("sd")
        assert slept is not None and slept.last_ack is not None and woke is not None
        assert woke.last_ack is not None and woke.last_ack.op == "wake" and woke.last_ack.ok
        ack = slept.last_ack
        assert ack.op == "sleep" and ack.ok and ack.drain_s > DRAIN_S / 2
        assert woke.last_ack.started_at > ack.finished_at  # no wake before ar's ok ACK
        print(f"c's ACK in status {took:.2f}s after the patch; ar drained {ack.drain_s:.1f}s")
    finally:
        gpu.nodes.clear_device_faults(gpu.node, gpu.device)
        op.stop()
        print(op.tail())
