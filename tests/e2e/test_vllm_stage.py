"""A vLLM stage and a torch stage hand over both ways, end to end (issues 9 and 23).

Real API server, localnode, the real operator and workers; the vLLM stage runs the STAND-IN
engine (``tests/fakevllm``, put on the stage's PYTHONPATH: CI has no vLLM), whose engine core
is a child process holding real memory on the simulated GPU. The vLLM stage's pod starts asleep
before it is asked, pre-warmed at level 2 (vLLM imported, no engine, nothing on the device); its
first wake, sent only once the torch stage's sleep is ACKed, starts the engine; the two stages'
weights are never on the device together.
"""

from __future__ import annotations

import os
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
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    before = gpu.snapshot()
    cluster.apply(vllm_manifest(llm_dir, gpu.node))

    # Not asked: its pod runs pre-warmed, asleep at level 2, with nothing on the device.
    wait_for("llm Asleep (pre-warmed)", lambda: cluster.state("llm") == "Asleep", 180)
    pod = cluster.pod("llm")
    assert pod is not None
    args = pod["spec"]["containers"][0]["args"]
    assert args[args.index("--initial-state") + 1] == "asleep"
    assert args[args.index("--sleep-level") + 1] == "2"  # whatever spec.sleepLevel (1) says
    assert args[args.index("--vllm-memory-bytes") + 1] == str(LLM_REQUEST)
    asleep = _condition(cluster, "llm", "Asleep")
    assert asleep["status"] == "True" and "level 2" in asleep["message"], asleep
    snap = gpu.snapshot()
    assert set(snap.procs) == set(before.procs), "the pre-warmed vLLM stage holds device memory"
    assert snap.used_total == before.used_total
    llm = cluster.status("llm")
    assert llm.get("lastAck") is None, llm  # no order to reach the spec's level 1 (it cannot)
    uid = pod["metadata"]["uid"]

    with MemoryWatch(gpu) as watch:
        # torch -> vLLM: the torch stage sleeps (ACK), then the running vLLM pod is woken.
        cluster.patch_state("llm", "Active")
        wait_for("llm Active", lambda: cluster.state("llm") == "Active", 240)
        ar = cluster.status("ar")
        assert ar["state"] == "Waiting" and ar["waitingFor"] == ["llm"]
        assert ar["lastAck"]["op"] == "sleep" and ar["lastAck"]["ok"] is True
        pod = cluster.pod("llm")
        assert pod is not None and pod["metadata"]["uid"] == uid  # a wake, not a new pod
        ack = cluster.status("llm")["lastAck"]
        assert (ack["op"], ack["ok"]) == ("wake", True)
        first = list(_generate(cluster, "llm").text.token_ids)

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
    """The stand-in engine refuses to start at the first wake (its budget leaves no room for a
    KV cache): the worker stops what started and stays asleep at level 2 in the same pod; each
    failed wake counts into the stage's wake back-off (1, 2, 4 ... s), with the engine's reason
    in status; the torch stage of the group is woken meanwhile."""
    llm_dir = build_standin_model(tmp_path / "llm", weights=200_000)
    cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
    wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
    bad = vllm_manifest(llm_dir, gpu.node)
    bad["spec"]["state"] = "Active"
    bad["spec"]["vllm"]["gpuMemoryUtilization"] = 0.1  # under its weights: no KV cache
    cluster.apply(bad)

    def attempts() -> int:
        return int((cluster.status("llm").get("wakeBackoff") or {}).get("attempts", 0))

    wait_for("llm's first failed wake counted", lambda: attempts() >= 1, 240)
    ready = _condition(cluster, "llm", "Ready")
    assert "No available memory for the cache blocks" in ready["message"], ready
    pod = cluster.pod("llm")
    assert pod is not None
    uid = pod["metadata"]["uid"]
    # While it backs off, the torch stage has the GPU again and the failure is on llm alone.
    wait_for("ar Active again", lambda: cluster.state("ar") == "Active", 60)
    wait_for("llm's third failed wake counted", lambda: attempts() >= 3, 120)
    cluster.reasons_include("llm", {"WakeFailed"})
    pod = cluster.pod("llm")
    assert pod is not None and pod["metadata"]["uid"] == uid  # the same pod: no restarts
    llm = cluster.status("llm")
    assert llm.get("backoff") is None and llm["state"] in ("Asleep", "Waiting", "Waking"), llm
    snap = gpu.snapshot()
    assert sum(1 for p in snap.procs.values() if p.weights > 0) <= 1  # ar's, if any

    # The engine argument fixed (a new pod spec): its pod is replaced and woken, no waiting
    # out the back-off.
    cluster.cp.kubectl(
        "patch", "omnistage", "llm", "-n", cluster.namespace, "--type=merge",
        "-p", '{"spec":{"vllm":{"gpuMemoryUtilization":null}}}',
    )  # fmt: skip
    wait_for("llm Active", lambda: cluster.state("llm") == "Active", 180)
    assert cluster.status("llm").get("wakeBackoff") is None
    pod = cluster.pod("llm")
    assert pod is not None and pod["metadata"]["uid"] != uid
    cluster.reasons_include("llm", {"PodReplaced", "Woken"})
