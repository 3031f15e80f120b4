"""Component-level sleep driven from kubectl (issue 10), end to end.

Real API server, localnode playing the kubelet, real workers with tiny diffusers pipelines built
from configs, the real operator, one simulated GPU (``tests/fakegpu``). Stage "painter" has a
text encoder twice the size of the rest of its pipeline; stage "second" fits beside it only
while that encoder is asleep. ``kubectl patch`` of ``spec.asleepComponents`` is the only lever.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from omnistage_operator.decisions.arbiter import WorkerPhase
from tests.cluster.localnode import LocalNodes
from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.test_handover import MemoryWatch
from tests.worker.tiny_models import build_diffusion_pipeline

pytestmark = [pytest.mark.timeout(600)]

# painter: text encoder 2.18 MB + unet/vae 1.01 MB; second: 1.04 MB (asks 1.3 MB). Both whole do
# not fit in 3.5 MB (with the driver reserve and two contexts); painter without its encoder and
# second do.
GPU_BYTES = 3_500_000


def _patch_components(cluster: Cluster, stage: str, names: list[str]) -> None:
    cluster.cp.kubectl(
        "patch", "omnistage", stage, "-n", cluster.namespace, "--type=merge",
        "-p", json.dumps({"spec": {"asleepComponents": names}}),
    )  # fmt: skip


def _condition(cluster: Cluster, stage: str, kind: str) -> dict[str, Any]:
    for c in cluster.status(stage).get("conditions") or []:
        if c["type"] == kind:
            return dict(c)
    return {}


def _components(cluster: Cluster, stage: str) -> dict[str, str]:
    figures = (cluster.status(stage).get("memory") or {}).get("components") or []
    return {c["name"]: c["state"] for c in figures}


def test_patching_asleep_components_lets_a_second_stage_wake(
    cluster: Cluster, namespace: str, tmp_path: Path, make_local_nodes: Any
) -> None:
    models = {
        "sd": build_diffusion_pipeline(tmp_path / "painter", text_intermediate_size=8192),
    }
    small = {"sd": build_diffusion_pipeline(tmp_path / "second")}
    nodes: LocalNodes = make_local_nodes(nodes=1, gpus=1, gpu_memory=GPU_BYTES)
    gpu = Gpu(nodes, nodes.node_names[0])
    op = OperatorProcess(cluster.cp, namespace, tmp_path)
    op.start()
    try:
        cluster.apply(stage_manifest("painter", "sd", models, gpu.node, priority=1))
        wait_for("painter Active", lambda: cluster.state("painter") == "Active", 180)
        assert _components(cluster, "painter") == {
            "text_encoder": "Resident", "unet": "Resident", "vae": "Resident",
        }  # fmt: skip
        with MemoryWatch(gpu) as watch:
            # Its request stands for its footprint until its first wake is measured.
            wanted = stage_manifest("second", "sd", small, gpu.node, vram_request="1300000")
            cluster.apply(wanted)
            wait_for("second Waiting", lambda: cluster.state("second") == "Waiting", 180)
            time.sleep(3)  # a few rounds: it keeps waiting (the whole painter leaves no room)
            assert cluster.state("second") == "Waiting"
            assert _condition(cluster, "second", "Admitted")["reason"] == "LowerPriority"

            _patch_components(cluster, "painter", ["text_encoder"])
            wait_for("second Active", lambda: cluster.state("second") == "Active", 120)
            assert cluster.state("painter") == "Active"  # it kept serving throughout
            wait_for(
                "painter's encoder asleep in status",
                lambda: _components(cluster, "painter").get("text_encoder") == "Asleep",
                30,
            )
            settled = _condition(cluster, "painter", "ComponentsSettled")
            assert settled["status"] == "True" and settled["reason"] == "ComponentsAsleep"
            painter = cluster.worker_status("painter")
            second = cluster.worker_status("second")
            assert painter is not None and second is not None
            assert painter.phase is WorkerPhase.ACTIVE
            ack = painter.last_ack
            assert ack is not None and ack.op == "sleep" and ack.ok and ack.freed_bytes > 0
            assert second.last_ack is not None and second.last_ack.op == "wake"
            assert ack.finished_at < second.last_ack.started_at  # the ACK came first
            events = cluster.reasons_include("painter", {"ComponentsSlept"})
            slept = [e for e in events if e["reason"] == "ComponentsSlept"]
            assert "text_encoder" in slept[0]["message"]

            # Waking the encoder again needs room the second stage holds: painter waits.
            _patch_components(cluster, "painter", [])
            wait_for(
                "NoRoomForComponents",
                lambda: (
                    _condition(cluster, "painter", "ComponentsSettled").get("reason")
                    == "NoRoomForComponents"
                ),
                60,
            )
            assert cluster.state("second") == "Active"
            assert _components(cluster, "painter")["text_encoder"] == "Asleep"

            # The second stage goes to sleep: the encoder wakes.
            cluster.patch_state("second", "Asleep")
            wait_for(
                "painter's encoder resident",
                lambda: _components(cluster, "painter").get("text_encoder") == "Resident",
                120,
            )
        snap = gpu.snapshot()
        assert watch.samples > 0 and watch.max_sum <= snap.device.total, (watch.max_sum, snap)
        cluster.reasons_include("painter", {"ComponentsWoken"})
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")


def test_asleep_components_only_for_diffusion_stages(
    cluster: Cluster, tiny_models: dict[str, Path]
) -> None:
    manifest = stage_manifest("llm", "ar", tiny_models, "nowhere")
    manifest["spec"]["asleepComponents"] = ["text_encoder"]
    res = cluster.cp.kubectl(
        "apply", "-n", cluster.namespace, "-f", "-", input=json.dumps(manifest), check=False
    )
    assert res.returncode != 0 and "asleepComponents needs runner Diffusion" in res.stderr
    manifest = stage_manifest("pic", "sd", tiny_models, "nowhere")
    manifest["spec"]["asleepComponents"] = ["text encoder"]
    res = cluster.cp.kubectl(
        "apply", "-n", cluster.namespace, "-f", "-", input=json.dumps(manifest), check=False
    )
    assert res.returncode != 0 and "asleepComponents" in res.stderr
