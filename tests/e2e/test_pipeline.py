"""A pipeline end to end: an encoder stage feeding a diffusion stage on one simulated GPU with
room for one of them, 16 clients through the router at once, swapped per batch.

Real API server, localnode, real workers, the real operator and router. The tiny encoder (a
Llama of hidden width 16) and the tiny SD pipeline (cross-attention width 16) of one group are
OnDemand and do not fit together (``vram.request: 3500k`` each on a 5 MB simulated GPU, where
the DiT serving a batch of 8 takes about 3.1 MB: weights and 8 requests' activations); the
OmniPipeline's batch policy (maxBatch 8) bounds the hand-overs: 16 requests are at most two
round trips (clients arrive 0.2 s apart: the later ones find the encoder asleep and wait for
their batch). Every image equals the same pipeline run in this process (within 2/255 a pixel:
a batched call may round differently; alone it is bit-identical, tests/worker/test_embeds.py).
"""

from __future__ import annotations

import base64
import concurrent.futures
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.cluster.controlplane import CommandError, ControlPlane
from tests.cluster.localnode import LocalNodes
from tests.cluster.procs import terminate
from tests.e2e.conftest import (
    ROOT,
    Cluster,
    Gpu,
    OperatorProcess,
    _free_port,
    stage_manifest,
    stage_port,
    wait_for,
)
from tests.e2e.test_handover import MemoryWatch
from tests.worker.pipeline_reference import InProcessPipeline
from tests.worker.test_diffusion_batching import assert_same_image
from tests.worker.tiny_models import SENTENCES, build_causal_lm, build_diffusion_pipeline

pytestmark = [pytest.mark.timeout(600)]

PIPELINE_CRD = ROOT / "crds" / "omnipipelines.omnistage.io.yaml"
ROUTER = str(Path(sys.executable).parent / "omnistage-router")
CLIENTS = 16
MAX_BATCH = 8
FIELDS = {"height": 16, "width": 16, "num_inference_steps": 2, "guidance_scale": 1.0}
BODY = {"size": "16x16", "num_inference_steps": 2, "guidance_scale": 1.0}
ROOM = 5_000_000
STAGGER_S = 0.2  # client i sends at i * STAGGER_S: arrivals spread over 3 s, as real traffic
MAX_WAIT = "5s"
VRAM = "3500k"


@pytest.fixture(scope="session")
def pipeline_crd(omnistage_crd: ControlPlane) -> ControlPlane:
    omnistage_crd.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(PIPELINE_CRD))
    omnistage_crd.wait_crd_established("omnipipelines.omnistage.io")
    return omnistage_crd


@pytest.fixture
def gpu(make_local_nodes: Callable[..., LocalNodes]) -> Gpu:
    """One node with one simulated GPU of ``ROOM`` bytes: one stage fits, not both."""
    nodes = make_local_nodes(nodes=1, gpus=1, gpu_memory=ROOM)
    return Gpu(nodes, nodes.node_names[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pipeline-models")
    return {
        "ar": build_causal_lm(root / "enc", hidden_size=16, intermediate_size=32),
        "sd": build_diffusion_pipeline(root / "sd"),
    }


class RouterProcess:
    """``omnistage-router`` serving one pipeline, dialling the stages' pods."""

    def __init__(self, pipeline: str, grpc_routes: dict[str, str], log: Path) -> None:
        self.port = _free_port()
        argv = [ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--pipeline", pipeline]
        for stage, target in grpc_routes.items():
            argv += ["--grpc-route", f"{stage}={target}"]
        self.log = log
        with log.open("ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        wait_for("router /health", self._healthy, 60)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"router exited:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self) -> None:
        terminate(self.proc)


def pipeline_manifest(**batching: Any) -> dict[str, Any]:
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniPipeline",
        "metadata": {"name": "tiny-image"},
        "spec": {
            "stages": [{"name": "enc", "passes": "Embeds"}, {"name": "dit"}],
            "batching": batching,
        },
    }


def _grpc_target(cluster: Cluster, stage: str) -> str:
    pod = cluster.pod(stage)
    assert pod is not None
    return f"{pod['status']['podIP']}:{stage_port(pod)}"


@pytest.fixture
def router(cluster: Cluster, tmp_path: Path) -> Iterator[list[RouterProcess]]:
    started: list[RouterProcess] = []
    yield started
    for r in started:
        r.stop()
        print(f"--- router log tail ---\n{r.log.read_text()[-2000:]}")


def test_sixteen_clients_two_round_trips_and_outputs_equal_one_process(  # noqa: PLR0917
    pipeline_crd: ControlPlane,
    cluster: Cluster,
    operator: OperatorProcess,
    models: dict[str, Path],
    gpu: Gpu,
    router: list[RouterProcess],
    tmp_path: Path,
) -> None:
    node = gpu.node
    for name, kind in (("enc", "ar"), ("dit", "sd")):
        manifest = stage_manifest(
            name,
            kind,
            models,
            node,
            state="Asleep",
            vram_request=VRAM,
        )
        manifest["spec"]["activation"] = {"policy": "OnDemand"}
        manifest["spec"]["limits"] = {"maxBatch": MAX_BATCH}
        cluster.apply(manifest)
    cluster.apply(pipeline_manifest(maxBatch=MAX_BATCH, maxWait=MAX_WAIT))
    wait_for("enc Asleep", lambda: cluster.state("enc") == "Asleep", 180)
    wait_for("dit Asleep", lambda: cluster.state("dit") == "Asleep", 180)
    targets = {s: _grpc_target(cluster, s) for s in ("enc", "dit")}
    router.append(RouterProcess("tiny-image=enc:embeds,dit", targets, tmp_path / "router.log"))
    base = router[0].url

    def pipeline_status() -> dict[str, Any]:
        body = cluster.cp.get_json("omnipipeline", "tiny-image", namespace=cluster.namespace)
        return dict(body.get("status") or {})

    wait_for("pipeline Ready", lambda: pipeline_status().get("conditions"), 60)
    assert pipeline_status()["conditions"][0]["status"] == "True"
    prompts = [SENTENCES[i % len(SENTENCES)] for i in range(CLIENTS)]
    seeds = list(range(CLIENTS))

    start = time.monotonic()

    def client(i: int) -> bytes:
        time.sleep(max(0.0, start + i * STAGGER_S - time.monotonic()))
        body = {"model": "tiny-image", "prompt": prompts[i], "seed": seeds[i], **BODY}
        with httpx.Client(timeout=300) as http:
            answer = http.post(f"{base}/v1/images/generations", json=body)
        assert answer.status_code == 200, answer.text
        return base64.b64decode(answer.json()["data"][0]["b64_json"])

    with (
        MemoryWatch(gpu) as watch,
        concurrent.futures.ThreadPoolExecutor(CLIENTS) as pool,
    ):
        images = list(pool.map(client, range(CLIENTS)))
    # never more on the GPU than it has (overlapped hand-overs: a wake takes only what the
    # sleep beside it released)
    assert watch.samples > 0 and watch.max_sum <= ROOM

    reference = InProcessPipeline(models["ar"], models["sd"])
    for got, want in zip(images, reference.images(prompts, seeds, FIELDS), strict=True):
        assert_same_image(got, want)  # a batched call may round a pixel differently

    def counted() -> dict[str, Any] | None:
        status = pipeline_status()
        return status if status.get("batches", 0) >= 2 else None

    status = wait_for("the pipeline's batches in status", counted, 30)
    # 16 requests, batches of 8: at most two round trips (enc -> dit -> enc -> dit).
    assert 1 <= status["swaps"] <= 3, status
    assert status["batches"] <= 4, status
    assert [s["name"] for s in status["stages"]] == ["enc", "dit"]
    events = cluster.events("tiny-image")
    assert any(e["reason"] == "Swapped" for e in events), events
    assert "omnistage_pipeline_swaps_total" in operator.metrics()
    print(f"pipeline status after {CLIENTS} clients: {status}")


def test_a_lone_request_waits_for_its_batch_beside_the_awake_stage(  # noqa: PLR0917
    pipeline_crd: ControlPlane,
    cluster: Cluster,
    operator: OperatorProcess,
    models: dict[str, Path],
    gpu: Gpu,
    router: list[RouterProcess],
    tmp_path: Path,
) -> None:
    """One request: the encoder wakes for it at once (nothing else is awake), then its embeds
    are held by the DiT, which does not displace the encoder before maxWait (a batch of 1 is
    not worth a swap yet); without the policy the DiT would wake within a second."""
    wait_s = 6.0
    for name, kind in (("enc", "ar"), ("dit", "sd")):
        manifest = stage_manifest(name, kind, models, gpu.node, state="Asleep", vram_request=VRAM)
        manifest["spec"]["activation"] = {"policy": "OnDemand"}
        manifest["spec"]["limits"] = {"maxBatch": MAX_BATCH}
        cluster.apply(manifest)
    cluster.apply(pipeline_manifest(maxBatch=MAX_BATCH, maxWait=f"{wait_s:g}s"))
    wait_for("enc Asleep", lambda: cluster.state("enc") == "Asleep", 180)
    wait_for("dit Asleep", lambda: cluster.state("dit") == "Asleep", 180)
    targets = {s: _grpc_target(cluster, s) for s in ("enc", "dit")}
    router.append(RouterProcess("tiny-image=enc:embeds,dit", targets, tmp_path / "router.log"))
    body = {"model": "tiny-image", "prompt": SENTENCES[0], "seed": 4, **BODY}
    with MemoryWatch(gpu) as watch, httpx.Client(timeout=120) as http:
        sent = time.monotonic()
        answer = http.post(f"{router[0].url}/v1/images/generations", json=body)
        took = time.monotonic() - sent
    assert answer.status_code == 200, answer.text
    assert took >= wait_s, f"served after {took:.2f}s: the DiT did not wait for its batch"
    assert watch.max_resident == 1
    want = InProcessPipeline(models["ar"], models["sd"]).images([SENTENCES[0]], [4], FIELDS)
    assert base64.b64decode(answer.json()["data"][0]["b64_json"]) == want[0]  # alone: exact
    print(f"a lone request served after {took:.2f}s (maxWait {wait_s:g}s)")


def test_the_api_server_refuses_a_malformed_pipeline(
    pipeline_crd: ControlPlane, cluster: Cluster, operator: OperatorProcess
) -> None:
    enc, dit = {"name": "enc", "passes": "Embeds"}, {"name": "dit"}
    for stages, batching, message in (
        ([enc, {"name": "dit", "passes": "Text"}], {}, "the last stage makes the output"),
        ([{"name": "enc"}, dit], {}, "every stage but the last says what it passes"),
        ([dit], {}, "should have at least 2 items"),
        ([{"name": "enc", "passes": "Pickle"}, dit], {}, 'supported values: "Embeds", "Text"'),
        ([enc, dit], {"maxBatch": 0}, "spec.batching.maxBatch"),
        ([enc, dit], {"maxWait": "soon"}, "spec.batching.maxWait"),
        ([enc, {"name": "enc"}], {}, "Duplicate value"),
    ):
        manifest = pipeline_manifest(**batching)
        manifest["spec"]["stages"] = stages
        with pytest.raises(CommandError) as info:
            cluster.apply(manifest)
        assert message in info.value.stderr, info.value.stderr
    cluster.apply(pipeline_manifest())
    spec = cluster.cp.get_json("omnipipeline", "tiny-image", namespace=cluster.namespace)["spec"]
    assert spec["batching"] == {"maxBatch": 8, "maxWait": "2s", "minResidency": "0s"}

    def ready() -> dict[str, Any] | None:
        got = cluster.cp.get_json("omnipipeline", "tiny-image", namespace=cluster.namespace)
        conditions = (got.get("status") or {}).get("conditions") or []
        return conditions[0] if conditions else None

    # Valid, but none of its stages exists: the operator says so in its status.
    cond = wait_for("the pipeline's Ready condition", ready, 60)
    assert (cond["status"], cond["reason"]) == ("False", "StageMissing"), cond
    assert cond["message"] == "no OmniStage enc, dit"
