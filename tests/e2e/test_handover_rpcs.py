"""What one hand-over costs the workers: the RPCs each one answers, counted by the worker itself.

Real API server, localnode, real workers and the real operator, as in ``test_handover``. A
hand-over from ``ar`` to ``sd`` takes one Sleep (ar; a SleepStream when overlapped, the default),
one WakeUp (sd), and at most one GetStatus
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
from tests.e2e.conftest import Cluster, Gpu, wait_for
from tests.e2e.handover_counting import delta, resting_pair, rounds

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


KEPT = "omnistage_rounds_from_kept_readings_total"


@pytest.mark.parametrize("mode", ["overlapped", "serial"])
def test_a_handover_asks_each_worker_once_per_round(
    mode: str, cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> None:
    flags = [f"--{'' if mode == 'overlapped' else 'no-'}overlapped-handover"]
    with resting_pair(cluster, tiny_models, gpu, tmp_path, flags) as op:

        def quiet() -> tuple[float, dict[str, float], dict[str, float]] | None:
            """Counters that did not move for a while (the start's rounds are over)."""
            seen = (rounds(op, cluster.namespace), _worker_rpcs(cluster, "ar"))
            time.sleep(0.5)  # the window the counters must stay still over (polled again)
            again = (rounds(op, cluster.namespace), _worker_rpcs(cluster, "ar"))
            if seen != again:
                return None
            return again[0], again[1], _worker_rpcs(cluster, "sd")

        rounds0, ar0, sd0 = wait_for("the group at rest", quiet, 60)
        kept0 = rounds(op, cluster.namespace, KEPT)
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 30)
        rounds1, ar1, sd1 = wait_for("the group at rest", quiet, 60)
        kept = rounds(op, cluster.namespace, KEPT) - kept0

    ran = rounds1 - rounds0
    assert ran >= 1 and kept <= 1
    streamed = delta(ar1, ar0, "SleepStream")
    assert delta(ar1, ar0, "Sleep") + streamed == 1 and delta(ar1, ar0, "WakeUp") == 0
    assert streamed == (mode == "overlapped")  # the sleep streamed with the wake beside it
    assert delta(sd1, sd0, "WakeUp") == 1 and delta(sd1, sd0, "Sleep") == 0
    # Each worker read once per round; when the hand-over's round sent its Sleep from the
    # readings kept from the round before, it read only sd (asleep, beside the sleep), never
    # ar; it asked nobody again after an ACK.
    assert delta(ar1, ar0, "GetStatus") == ran - kept, (ran, kept, ar0, ar1)
    assert delta(sd1, sd0, "GetStatus") == ran, (ran, kept, sd0, sd1)
