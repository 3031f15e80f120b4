"""``spec.limits`` and ``spec.http.authSecret`` end to end: the real API server checks them, the
operator passes them to the worker, the worker enforces them.

Real API server, localnode, a real worker, the real operator.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for
from tests.e2e.test_ondemand import http_url

pytestmark = [pytest.mark.timeout(600)]
TOKEN = "e2e-api-token"


def _refusal(cluster: Cluster, manifest: dict[str, Any]) -> str:
    proc = cluster.cp.kubectl(
        "apply", "--validate=strict", "-n", cluster.namespace, "-f", "-",
        input=json.dumps(manifest), check=False,
    )  # fmt: skip
    assert proc.returncode != 0, f"applied: {proc.stdout}"
    return proc.stderr


def test_limits_and_the_api_token_reach_the_worker(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu_node: str
) -> None:
    bad = stage_manifest("bad", "ar", tiny_models, gpu_node, group="glimits")
    bad["spec"]["limits"] = {"promptTokens": 0}
    assert "spec.limits.promptTokens" in _refusal(cluster, bad)
    bad["spec"]["limits"] = {}
    bad["spec"]["worker"]["args"] = ["--max-prompt-tokens=99999"]
    assert "--max-prompt-tokens" in _refusal(cluster, bad)
    bad["spec"]["worker"]["args"] = ["--max-batch=4"]
    assert "--max-batch" in _refusal(cluster, bad)
    bad["spec"]["worker"]["args"] = []
    bad["spec"]["limits"] = {"maxBatch": 1025}
    assert "spec.limits.maxBatch" in _refusal(cluster, bad)

    cluster.cp.kubectl(
        "create", "secret", "generic", "llm-api", f"--from-literal=token={TOKEN}",
        "-n", cluster.namespace,
    )  # fmt: skip
    stage = stage_manifest("ar", "ar", tiny_models, gpu_node, group="glimits")
    stage["spec"]["limits"] = {"promptTokens": 4, "maxBatch": 3}
    stage["spec"]["http"] = {"authSecret": {"name": "llm-api"}}
    cluster.apply(stage)
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    pod = cluster.pod("ar")
    assert pod is not None
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--max-batch") + 1] == "3"
    url = http_url(cluster, "ar")
    auth = {"authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=url, timeout=60) as http:
        assert http.get("/health").status_code == 200  # open
        body = {"prompt": "the cat", "max_tokens": 2}
        denied = http.post("/v1/completions", json=body)
        assert denied.status_code == 401
        assert denied.json()["error"]["code"] == "invalid_api_key"
        served = http.post("/v1/completions", json=body, headers=auth)
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] == 2
        long = http.post("/v1/completions", json={"prompt": "the cat sat on the mat"}, headers=auth)
        assert long.status_code == 400 and long.json()["error"]["param"] == "prompt"
    assert TOKEN not in operator.tail(400)
