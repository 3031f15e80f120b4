"""A worker that reports another number of devices than ``spec.gpus`` is never admitted.

Issue 19, item 4: the CRD refuses every flag that could change the device count, but a pod can
still come from elsewhere (made by hand or by another tool, with the stage's labels and pod-spec
digest, so the operator takes it for the stage's own). Here the stage asks for 2 GPUs and the
pod's worker was started with ``--gpus 1``: it measures one device of the group's claim, so its
figures do not cover what the arbiter would charge. The operator must say so (a
``DeviceMismatch`` condition and Event with both counts) and never wake it, although the
group's memory is free.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod, owner_reference, pod_claim_name
from tests.cluster.localnode import LocalNodes
from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, wait_for
from tests.e2e.test_physics import _conditions

pytestmark = [pytest.mark.timeout(600)]
PER_DEVICE = 1_100_000


def _two_gpus(name: str, models: dict[str, Path], node: str, state: str) -> dict[str, Any]:
    manifest = stage_manifest(
        name, "ar", models, node, state=state, worker_args=["--cpu-threads=1"]
    )
    manifest["spec"]["gpus"] = 2
    return manifest


def test_a_worker_on_fewer_devices_than_its_spec_is_refused(
    cluster: Cluster, operator: OperatorProcess, tiny_models: dict[str, Path], make_local_nodes: Any
) -> None:
    nodes: LocalNodes = make_local_nodes(nodes=1, gpus=2, gpu_memory=PER_DEVICE)
    node = nodes.node_names[0]
    # A healthy stage of the group makes the operator create the group's 2-GPU claim.
    cluster.apply(_two_gpus("ok", tiny_models, node, "Asleep"))
    wait_for("ok Asleep", lambda: cluster.state("ok") == "Asleep", 240)

    # The operator is stopped while the stage and its foreign pod appear (a running operator
    # would create the stage's own pod first, or fence a pod whose stage it does not know).
    operator.stop()
    manifest = _two_gpus("odd", tiny_models, node, "Active")
    cluster.apply(manifest)
    body = cluster.stage("odd")
    spec = parse_stage(body)
    pod = build_worker_pod(
        spec,
        initial_state=DesiredState.ASLEEP,
        owner=owner_reference(body),
        claim_name=pod_claim_name(spec),
    )
    pod["spec"]["containers"][0]["args"] += ["--gpus", "1"]  # the last --gpus wins
    cluster.cp.kubectl("apply", "-n", cluster.namespace, "-f", "-", input=json.dumps(pod))
    wait_for("the foreign pod's worker", lambda: cluster.worker_status("odd") is not None, 240)
    operator.start()

    def mismatch() -> dict[str, Any] | None:
        ready = _conditions(cluster, "odd").get("Ready") or {}
        return ready if ready.get("reason") == "DeviceMismatch" else None

    ready = wait_for("odd's Ready to say DeviceMismatch", mismatch, 180)
    assert "reports 1 device(s)" in ready["message"] and "spec.gpus is 2" in ready["message"]
    cluster.reasons_include("odd", {"DeviceMismatch"})
    time.sleep(5)  # rounds go on: the stage is still never woken
    rep = cluster.worker_status("odd")
    assert rep is not None and rep.phase.value == "Asleep"
    assert rep.last_ack is None or rep.last_ack.op != "wake"
    assert cluster.state("odd") != "Active"
    assert mismatch() is not None
