"""OnDemand stages end to end: a request to an asleep stage is held and served after the
operator's ACK-gated hand-over; an idle stage goes to sleep by itself.

Real API server, localnode, real workers, the real operator. Two tiny AR stages of one group
each declare ``vram.request: 600k`` on a simulated GPU of ``CAPACITY`` (1.1 MB), so the operator
never lets both be awake.
"""

from __future__ import annotations

import concurrent.futures
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import CAPACITY, Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.holding_log import handed_over
from tests.e2e.test_handover import MemoryWatch

pytestmark = [pytest.mark.timeout(600)]


def on_demand(manifest: dict[str, Any], **activation: str) -> dict[str, Any]:
    manifest["spec"]["activation"] = {"policy": "OnDemand", **activation}
    return manifest


def http_url(cluster: Cluster, stage: str) -> str:
    pod = cluster.pod(stage)
    assert pod is not None
    return f"http://{pod['status']['podIP']}:8000"


def test_a_held_request_is_served_after_the_hand_over(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu: Gpu
) -> None:
    node = gpu.node

    def stage(name: str) -> dict[str, Any]:
        return stage_manifest(name, "ar", tiny_models, node, state="Asleep", vram_request="600k")

    cluster.apply(on_demand(stage("ar")))
    cluster.apply(on_demand(stage("sd"), idleAfter="4s"))
    wait_for("ar Asleep", lambda: cluster.state("ar") == "Asleep", 180)
    wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 180)
    ar_url, sd_url = http_url(cluster, "ar"), http_url(cluster, "sd")
    pool = concurrent.futures.ThreadPoolExecutor(2)
    with MemoryWatch(gpu) as watch, httpx.Client(timeout=120) as http:
        # 1. The AR stage is asleep: its request is held, the operator wakes it, it is served.
        started = time.monotonic()
        text = pool.submit(
            http.post, f"{ar_url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}
        )
        answer = text.result(120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        first_wait = time.monotonic() - started
        # the status follows the round that woke it (the answer may come first)
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 30)
        wait_for(
            "ar awake for demand", lambda: cluster.status("ar").get("awakeReason") == "Demand", 30
        )
        # 2. The other stage's request is held until sd woke: after ar's sleep ACK, or beside
        # ar's sleep taking only what it released (overlapped).
        chat = pool.submit(
            http.post,
            f"{sd_url}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
        )
        answer = chat.result(120)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert watch.samples > 0 and watch.max_sum <= CAPACITY
    wait_for("ar Asleep after the swap", lambda: cluster.state("ar") == "Asleep", 30)
    ar_ack = cluster.worker_status("ar")
    sd_ack = cluster.worker_status("sd")
    assert ar_ack is not None and sd_ack is not None
    assert ar_ack.last_ack is not None and sd_ack.last_ack is not None
    assert ar_ack.last_ack.op == "sleep" and ar_ack.last_ack.ok
    assert handed_over("ar", ar_ack.last_ack, "sd", sd_ack.last_ack)
    sd_status = cluster.status("sd")
    assert sd_status["demand"]["heldRequests"] == 0
    assert sd_status["demand"]["lastRequestTime"]
    events = cluster.reasons_include("sd", {"DemandWake"})
    wake = next(e for e in events if e["reason"] == "DemandWake")
    assert "slept ar for it" in wake["message"]
    # 3. sd serves nothing more: asleep within idleAfter (4s) + 2s of its last request.
    served_at = time.monotonic()
    wait_for("sd idle asleep", lambda: cluster.state("sd") == "Asleep", 30)
    assert time.monotonic() - served_at <= 4 + 2 + 1.0  # + 1s of kubectl polling
    cluster.reasons_include("sd", {"IdleSleep"})
    metrics = operator.metrics()
    for name in (
        "omnistage_demand_swaps_total",
        "omnistage_held_requests_served_total",
        "omnistage_hold_seconds_total",
        "omnistage_idle_sleeps_total",
    ):
        assert name in metrics
    print(f"first held request served after {first_wait:.2f}s")
