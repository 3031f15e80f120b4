"""An awake OnDemand stage patched to ``state: Asleep`` goes to sleep now (issue 19, item 7).

On the H100 such a stage stayed Active for 60 s and more: without ``idleAfter`` (or while
busy, or within its residency) the demand rules kept asking for Active after the patch. Real
API server, localnode with a simulated GPU, a real worker, the real operator.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.test_ondemand import http_url, on_demand

pytestmark = [pytest.mark.timeout(600)]


def test_an_on_demand_stage_patched_asleep_sleeps_now_and_a_request_wakes_it(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    manifest = stage_manifest("ar", "ar", tiny_models, gpu.node, vram_request="600k")
    cluster.apply(on_demand(manifest, minResidency="1h"))  # no idleAfter: never idle by itself
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    url = http_url(cluster, "ar")
    body = {"prompt": "hi", "max_tokens": 2}
    with httpx.Client(timeout=120) as http:
        assert http.post(f"{url}/v1/completions", json=body).status_code == 200
        patched = time.monotonic()
        cluster.patch_state("ar", "Asleep")
        wait_for("ar Asleep after the patch", lambda: cluster.state("ar") == "Asleep", 30)
        took = time.monotonic() - patched
        rep = cluster.worker_status("ar")
        assert rep is not None and rep.last_ack is not None
        assert rep.last_ack.op == "sleep" and rep.last_ack.ok
        # The next request is held and wakes it again (spec.state stays Asleep).
        answer = http.post(f"{url}/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
    # woken by its demand, then kept for its residency
    reasons = {"Demand", "Residency"}
    wait_for("ar Active again", lambda: cluster.status("ar").get("awakeReason") in reasons)
    assert cluster.state("ar") == "Active"
    print(f"patch -> Asleep in {took:.2f}s")
