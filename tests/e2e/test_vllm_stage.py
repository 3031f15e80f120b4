"""A vLLM stage and a torch stage hand over both ways, end to end (issue 9).

Real API server, localnode, the real operator and workers; the vLLM stage runs the STAND-IN
engine (``tests/fakevllm``, put on the stage's PYTHONPATH: CI has no vLLM), whose engine core
is a child process holding real memory on the simulated GPU. The vLLM stage takes its memory
while it starts, so its pod must not exist until it is admitted and the torch stage's sleep is
ACKed; the two stages' weights are never on the device together.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import CAPACITY, Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.test_handover import MemoryWatch
from tests.e2e.test_physics import _generate
from tests.fakevllm.models import STANDIN_PATH, build_standin_model

pytestmark = [pytest.mark.timeout(600)]

LLM_REQUEST = 1_000_000  # with the tiny Llama Active it does not fit: 1.1 MB device


def vllm_manifest(model_dir: Path, node: str) -> dict[str, Any]:
    """A VLLM stage on the stand-in engine, Asleep until asked."""
    m = stage_manifest("llm", "ar", {"ar": model_dir}, node, state="Asleep")
    spec = m["spec"]
    spec["backend"] = "VLLM"
    spec["worker"] = {"device": "cuda"}
    spec["vram"] = {"request": str(LLM_REQUEST)}
    spec["vllm"] = {"enforceEager": False, "maxModelLen": 512}
    path = os.pathsep.join(p for p in (str(STANDIN_PATH), "$(PYTHONPATH)") if p)
    spec["template"]["env"] = [{"name": "PYTHONPATH", "value": path}]
    return m


def _condition(cluster: Cluster, stage: str, kind: str) -> dict[str, Any]:
    for c in cluster.status(stage).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def test_vllm_and_torch_stages_hand_over_both_ways(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu: Gpu,
    tmp_path: Path,
) -> None:  # fmt: skip
    llm_dir = build_standin_model(tmp_path / "llm", weights=200_000)
    cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
    cluster.apply(vllm_manifest(llm_dir, gpu.node))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)

    # Not asked: no pod (vLLM would take its memory while starting), and status says why.
    wait_for(
        "llm says it starts when admitted",
        lambda: _condition(cluster, "llm", "Ready").get("reason") == "StartsWhenAdmitted",
        60,
    )
    assert cluster.pod("llm") is None

    with MemoryWatch(gpu) as watch:
        # torch -> vLLM: the torch stage sleeps (ACK), then the vLLM pod starts Active.
        cluster.patch_state("llm", "Active")
        wait_for("llm Active", lambda: cluster.state("llm") == "Active", 240)
        ar = cluster.status("ar")
        assert ar["state"] == "Waiting" and ar["waitingFor"] == ["llm"]
        assert ar["lastAck"]["op"] == "sleep" and ar["lastAck"]["ok"] is True
        pod = cluster.pod("llm")
        assert pod is not None
        args = pod["spec"]["containers"][0]["args"]
        assert args[args.index("--initial-state") + 1] == "active"
        assert args[args.index("--vllm-memory-bytes") + 1] == str(LLM_REQUEST)
        first = list(_generate(cluster, "llm").text.token_ids)
        uid = pod["metadata"]["uid"]

        # vLLM -> torch: the vLLM stage sleeps; what it keeps is what its engine holds asleep.
        cluster.patch_state("llm", "Asleep")
        wait_for("ar Active again", lambda: cluster.state("ar") == "Active", 180)
        wait_for("llm Asleep", lambda: cluster.state("llm") == "Asleep", 60)
        llm = cluster.status("llm")
        ack = llm["lastAck"]
        assert (ack["op"], ack["ok"], ack["level"]) == ("sleep", True, 1)
        snap = gpu.snapshot()
        engine = [p for p in snap.procs.values() if p.used == ack["usedAfterBytes"]]
        assert engine and engine[0].weights == 0  # its weights and KV cache are off the GPU
        assert llm["memory"]["usedBytes"] == ack["usedAfterBytes"] > 0

        # And back: the asleep vLLM stage is woken through the gate (same pod), same tokens.
        cluster.patch_state("llm", "Active")
        wait_for("llm Active again", lambda: cluster.state("llm") == "Active", 180)
        assert cluster.status("ar")["lastAck"]["op"] == "sleep"
        pod = cluster.pod("llm")
        assert pod is not None and pod["metadata"]["uid"] == uid
        assert list(_generate(cluster, "llm").text.token_ids) == first

    assert watch.samples > 0 and watch.max_sum <= CAPACITY
    assert watch.max_resident == 1  # the two stages' weights were never on the GPU together
    cluster.reasons_include("llm", {"PodCreated", "Slept", "Woken"})


def test_a_vllm_stage_that_cannot_start_backs_off_and_its_group_hands_over(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], gpu: Gpu,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The stand-in engine refuses to start (its budget leaves no room for a KV cache): each
    failed start counts into the stage's crash back-off (10 s, then 20 s before the next pod),
    with the engine's reason in status; the torch stage of the group is woken meanwhile."""
    llm_dir = build_standin_model(tmp_path / "llm", weights=200_000)
    cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    bad = vllm_manifest(llm_dir, gpu.node)
    bad["spec"]["state"] = "Active"
    bad["spec"]["vllm"]["gpuMemoryUtilization"] = 0.1  # under its weights: no KV cache
    cluster.apply(bad)

    starts: dict[str, float] = {}  # pod uid -> when first seen

    def restarts(n: int) -> bool:
        pod = cluster.pod("llm")
        if pod is not None:
            starts.setdefault(pod["metadata"]["uid"], time.monotonic())
        return int((cluster.status("llm").get("backoff") or {}).get("restarts", 0)) >= n

    wait_for("llm's first failed start counted", lambda: restarts(1), 240)
    backoff = cluster.status("llm")["backoff"]
    assert "No available memory for the cache blocks" in backoff["message"]
    # While it backs off, the torch stage has the GPU again and the failure is on llm alone.
    wait_for("ar Active again", lambda: cluster.state("ar") == "Active", 60)
    ready = _condition(cluster, "llm", "Ready")
    assert ready["reason"] == "WorkerExited" and "cache blocks" in ready["message"]
    wait_for("llm's second failed start counted", lambda: restarts(2), 120)
    wait_for("llm's third pod", lambda: restarts(2) and len(starts) >= 3, 120)
    times = sorted(starts.values())
    assert times[1] - times[0] >= 9 and times[2] - times[1] >= 19  # 10 s, then 20 s
    cluster.reasons_include("llm", {"WorkerExited"})

    # The engine argument fixed (a new pod spec): no waiting out the back-off, it starts now.
    wait_for("llm's third failed start counted", lambda: restarts(3), 120)
    until = cluster.status("llm")["backoff"]["until"]
    fixed = time.monotonic()
    cluster.cp.kubectl(
        "patch", "omnistage", "llm", "-n", cluster.namespace, "--type=merge",
        "-p", '{"spec":{"vllm":{"gpuMemoryUtilization":null}}}',
    )  # fmt: skip
    wait_for("llm Active", lambda: cluster.state("llm") == "Active", 120)
    assert time.monotonic() - fixed < 40  # the third back-off alone is 40 s
    assert cluster.status("llm").get("backoff") is None, until
    cluster.reasons_include("llm", {"BackoffReset"})
