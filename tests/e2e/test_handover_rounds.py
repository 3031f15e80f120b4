"""How many rounds one hand-over between OnDemand stages takes, counted by the operator.

Real API server, localnode, real workers and the real operator, as in ``test_ondemand``: two
tiny OnDemand AR stages of one group, of which the simulated GPU holds one. The operator
follows each worker's demand stream, which reports every change of the worker's state. The
round that hands over sees those changes itself (its own ACKs), so the reports of its sleep and
wake carry nothing new: the hand-over settles in that one round. Before, each report kicked the
group again and a second round ran (two per group in the scale bench's storms).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for
from tests.e2e.handover_counting import at_rest, delta
from tests.e2e.test_ondemand import http_url, on_demand

pytestmark = [pytest.mark.timeout(600)]

BODY = {"prompt": "hi", "max_tokens": 2}


@contextmanager
def _woken_by_demand(
    cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> Iterator[OperatorProcess]:
    """The operator, with ``a`` and ``b`` (both ``spec.state: Asleep``) woken in turn by a
    request each, as the scale bench's groups: ``b`` Active for its demand, ``a`` Asleep."""
    op = OperatorProcess(cluster.cp, cluster.namespace, tmp_path)
    op.extra = ["--resync-interval", "600"]  # no timer round in the window
    op.start()
    try:
        for name in ("a", "b"):
            manifest = stage_manifest(
                name, "ar", tiny_models, gpu.node, state="Asleep", vram_request="600k"
            )
            cluster.apply(on_demand(manifest))
        wait_for(
            "a and b Asleep", lambda: cluster.state("a") == cluster.state("b") == "Asleep", 180
        )
        with httpx.Client(timeout=120) as http:
            for name in ("a", "b"):
                answer = http.post(f"{http_url(cluster, name)}/v1/completions", json=BODY)
                assert answer.status_code == 200, answer.text
        wait_for("b Active", lambda: cluster.state("b") == "Active", 60)
        wait_for("a Asleep", lambda: cluster.state("a") == "Asleep", 60)
        yield op
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")


WRITES = ("PATCH", "PUT")
"""What an operator writes to a stage. Not creations and deletions: on the shared control plane
the namespace controller keeps deleting the earlier tests' namespaces meanwhile."""


def _at_rest(cluster: Cluster, op: OperatorProcess) -> tuple[float, dict[str, float]]:
    """The group's rounds and writes on OmniStages, once still for longer than a busy round's
    follow-up can be pending (at most 2 s after it: ``group_loops``)."""
    return at_rest(cluster, op, 2.5, WRITES)


def test_a_handover_between_ondemand_stages_takes_one_round(
    cluster: Cluster, tiny_models: dict[str, Path], gpu: Gpu, tmp_path: Path
) -> None:
    with _woken_by_demand(cluster, tiny_models, gpu, tmp_path) as op:
        rounds0, before = _at_rest(cluster, op)
        cluster.patch_state("a", "Active")
        wait_for("a Active", lambda: cluster.state("a") == "Active", 60)
        wait_for("b Asleep", lambda: cluster.state("b") == "Asleep", 30)
        rounds1, after = _at_rest(cluster, op)

    assert rounds1 - rounds0 == 1, (rounds0, rounds1)
    # each stage's status written once: b's sleep (the checkpoint), a's wake
    assert delta(after, before, "PATCH omnistages/status") == 2, (before, after)
    assert cluster.status("b").get("awakeReason") is None
