"""What one hand-over costs the workers: the RPCs each one answers, counted by the worker itself.

Real API server, localnode, real workers and the real operator, as in ``test_handover``. A
hand-over from ``ar`` to ``sd`` takes one Sleep (ar), one WakeUp (sd), and at most one GetStatus
of each worker per round: the round reads the group before its plan, unless the round before
left readings that are still the group's (then its Sleep goes out from those:
``omnistage_rounds_from_kept_readings_total``, and it reads only the asleep sd, beside the
sleep); after the sleep ACK and
after the wake ACK the ACKs themselves say where the group stands (the ACKed worker's state and
every device figure, measured by the worker), so no worker is asked again within the round.
Counted from the workers' ``omnistage_worker_requests_total`` and the operator's rounds (any
other round in the window, a resync, reads each worker once more).
"""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from omnistage_operator.api.spec import DEFAULT_METRICS_PORT
from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for

pytestmark = [pytest.mark.timeout(600)]

SERVICE = "omnistage.worker.v1.SleepService"


def _worker_rpcs(cluster: Cluster, stage: str) -> dict[str, float]:
    """The SleepService answers of ``stage``'s worker so far, by method."""
    ip = ((cluster.pod(stage) or {}).get("status") or {}).get("podIP")
    assert ip, f"{stage} has no pod address"
    url = f"http://{ip}:{DEFAULT_METRICS_PORT}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            route = sample.labels.get("route", "")
            if sample.name == "omnistage_worker_requests_total" and route.startswith(SERVICE):
                method = route.rsplit("/", 1)[1]
                out[method] = out.get(method, 0.0) + sample.value
    return out


def _rounds(op: OperatorProcess, namespace: str, name: str = "omnistage_rounds_total") -> float:
    """The operator's rounds of group g1 so far (those counted by the counter ``name``)."""
    total = 0.0
    for family in text_string_to_metric_families(op.metrics()):
        for sample in family.samples:
            if (
                sample.name == name
                and sample.labels.get("namespace") == namespace
                and sample.labels.get("group") == "g1"
            ):
                total += sample.value
    return total


KEPT = "omnistage_rounds_from_kept_readings_total"


def _delta(after: dict[str, float], before: dict[str, float], method: str) -> float:
    return after.get(method, 0.0) - before.get(method, 0.0)


def test_a_handover_asks_each_worker_once_per_round(
    cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> None:
    op = OperatorProcess(cluster.cp, cluster.namespace, tmp_path)
    op.extra = ["--resync-interval", "600"]  # no timer round in the window
    op.start()
    try:
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu.node, state="Asleep"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)

        def quiet() -> tuple[float, dict[str, float], dict[str, float]] | None:
            """Counters that did not move for a while (the start's rounds are over)."""
            seen = (_rounds(op, cluster.namespace), _worker_rpcs(cluster, "ar"))
            time.sleep(0.5)  # the window the counters must stay still over (polled again)
            again = (_rounds(op, cluster.namespace), _worker_rpcs(cluster, "ar"))
            if seen != again:
                return None
            return again[0], again[1], _worker_rpcs(cluster, "sd")

        rounds0, ar0, sd0 = wait_for("the group at rest", quiet, 60)
        kept0 = _rounds(op, cluster.namespace, KEPT)
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 30)
        rounds1, ar1, sd1 = wait_for("the group at rest", quiet, 60)
        kept = _rounds(op, cluster.namespace, KEPT) - kept0
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")

    rounds = rounds1 - rounds0
    assert rounds >= 1 and kept <= 1
    assert _delta(ar1, ar0, "Sleep") == 1 and _delta(ar1, ar0, "WakeUp") == 0
    assert _delta(sd1, sd0, "WakeUp") == 1 and _delta(sd1, sd0, "Sleep") == 0
    # Each worker read once per round; when the hand-over's round sent its Sleep from the
    # readings kept from the round before, it read only sd (asleep, beside the sleep), never
    # ar; it asked nobody again after an ACK.
    assert _delta(ar1, ar0, "GetStatus") == rounds - kept, (rounds, kept, ar0, ar1)
    assert _delta(sd1, sd0, "GetStatus") == rounds, (rounds, kept, sd0, sd1)
