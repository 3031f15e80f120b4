"""What the hand-over counting tests share (``test_handover_rpcs``, ``test_handover_writes``,
``test_handover_rounds``): the operator's round counters, the API server's requests on the
stages, counter deltas, and a group of two tiny stages at rest (ar Active, sd Asleep) under an
operator whose resync timer stays out of the window."""

from __future__ import annotations

import time
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from bench.scale_probe import apiserver_requests
from tests.e2e.conftest import Cluster, Gpu, OperatorProcess, stage_manifest, wait_for


def rounds(op: OperatorProcess, namespace: str, name: str = "omnistage_rounds_total") -> float:
    """The operator's rounds of group g1 so far (those counted by the counter ``name``)."""
    total = 0.0
    for family in text_string_to_metric_families(op.metrics()):
        for sample in family.samples:
            if (
                sample.name == name
                and sample.labels.get("namespace") == namespace
                and sample.labels.get("group") == "g1"
            ):
                total += sample.value
    return total


def stage_requests(cluster: Cluster) -> dict[str, float]:
    """The API server's answered requests on OmniStages so far, by ``VERB resource``."""
    served = apiserver_requests(cluster.cp).items()
    return {k: v for k, v in served if k.split(" ", 1)[1].split("/")[0] == "omnistages"}


def at_rest(
    cluster: Cluster, op: OperatorProcess, window_s: float, verbs: Collection[str] | None = None
) -> tuple[float, dict[str, float]]:
    """The group's rounds and the API server's requests on OmniStages (of ``verbs`` only, when
    given), once both stayed still over ``window_s``."""

    def counters() -> tuple[float, dict[str, float]]:
        served = stage_requests(cluster)
        if verbs is not None:
            served = {k: v for k, v in served.items() if k.split(" ", 1)[0] in verbs}
        return rounds(op, cluster.namespace), served

    def quiet() -> tuple[float, dict[str, float]] | None:
        seen = counters()
        time.sleep(window_s)  # the window the counters must stay still over (polled again)
        again = counters()
        return again if seen == again else None

    return wait_for("the group at rest", quiet, 60)


def delta(after: Mapping[str, float], before: Mapping[str, float], key: str) -> float:
    """How much the counter ``key`` moved (0 for one never seen)."""
    return after.get(key, 0.0) - before.get(key, 0.0)


@contextmanager
def resting_pair(
    cluster: Cluster,
    tiny_models: dict[str, Path],
    gpu: Gpu,
    tmp_path: Path,
    flags: Collection[str] = (),
) -> Iterator[OperatorProcess]:
    """The operator (with ``flags``), with ``ar`` Active and ``sd`` Asleep on the test GPU;
    stopped after (its log's end printed)."""
    op = OperatorProcess(cluster.cp, cluster.namespace, tmp_path)
    op.extra = ["--resync-interval", "600", *flags]  # no timer round in the window
    op.start()
    try:
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu.node, state="Active"))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu.node, state="Asleep"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 60)
        yield op
    finally:
        op.stop()
        print(f"--- operator log tail ---\n{op.tail()}")
