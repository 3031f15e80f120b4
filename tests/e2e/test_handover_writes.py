"""What one hand-over costs the API server in writes of the stages, counted by the API server.

Real API server, localnode, real workers and the real operator, as in ``test_handover``. A
hand-over asked by ``kubectl patch`` of ``spec.state`` writes no more to the stages than that
patch and their status: kopf keeps the spec it last handled in the operator's memory, not in an
annotation patched onto the stage after every change (each such PATCH of the main resource ran
the whole object's schema, CEL rules and managedFields again on the API server). A restarted
operator, which has no such memory, still takes an ask for Active made while none ran: the stage's
status, written before, carries no ask for it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.handover_counting import at_rest, delta, resting_pair

pytestmark = [pytest.mark.timeout(600)]

ANNOTATION = "omnistage.io/last-handled-configuration"


def test_a_handover_writes_the_stages_only_their_status_beside_the_users_patch(
    cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> None:
    with resting_pair(cluster, tiny_models, gpu, tmp_path) as op:
        rounds0, before = at_rest(cluster, op, 0.5)  # the start's rounds are over
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 120)
        wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 30)
        rounds1, after = at_rest(cluster, op, 0.5)

    # The test's own patch is the only PATCH of a stage's main resource (kopf wrote its record
    # of the change as a second one).
    assert delta(after, before, "PATCH omnistages") == 1, (before, after)
    for name in ("ar", "sd"):
        assert ANNOTATION not in (cluster.stage(name)["metadata"].get("annotations") or {})
    # Status: each stage's new state once per round at most (ar's ACK, sd's Active; a wake
    # slower than 1 s also shows Waking).
    status = delta(after, before, "PATCH omnistages/status")
    assert 2 <= status <= 2 * (rounds1 - rounds0) + 1, (status, rounds1 - rounds0)


def test_an_ask_made_while_no_operator_ran_is_taken_by_the_next_one(
    cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> None:
    op = OperatorProcess(cluster.cp, cluster.namespace, tmp_path)
    op.start()
    try:
        # sd is created first: its creation is not the latest ask, its patch below is.
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu.node, state="Asleep"))
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 180)
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        op.kill()
        cluster.patch_state("sd", "Active")  # while no operator runs
        (tmp_path / "second").mkdir()
        op = OperatorProcess(cluster.cp, cluster.namespace, tmp_path / "second")
        op.start()
        wait_for("sd Active after the restart", lambda: cluster.state("sd") == "Active", 120)
        wait_for("ar Waiting", lambda: cluster.state("ar") == "Waiting", 30)
        assert cluster.status("sd").get("requestedActiveAt")
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")
