"""Kubernetes-issued credentials: the real kube-apiserver issues the tokens and reviews them for
a real in-process worker; only the operator's ServiceAccount, for the worker audience and not
expired, may order Sleep/WakeUp."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_operator.decisions.handover import WorkerUnauthenticated
from omnistage_operator.k8s.worker_client import WorkerClient
from omnistage_operator.k8s.worker_credentials import WORKER_SERVICE_ACCOUNT
from omnistage_worker.token_review_settings import TokenReviewSettings
from tests.cluster.controlplane import ControlPlane
from tests.e2e.conftest import Cluster, OperatorProcess, stage_manifest, stage_port, wait_for
from tests.worker.conftest import StartWorker, WorkerHandle, lm_dir, start_worker

__all__ = ["lm_dir", "start_worker"]  # fixtures used here
pytestmark = [pytest.mark.timeout(600)]
AUD = "omnistage-worker"


def _token(cp: ControlPlane, ns: str, sa: str, audience: str | None = AUD) -> str:
    aud = [f"--audience={audience}"] if audience else []
    return cp.kubectl("create", "token", sa, "-n", ns, *aud).stdout.strip()


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _expired(cp: ControlPlane, token: str) -> str:
    """``token`` with its validity moved into the past, signed again by the cluster's key (the
    API server's minimum lifetime is 10 minutes; this is the same token, expired)."""
    head, body, _ = token.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    now = int(time.time())
    claims.update(iat=now - 1200, nbf=now - 1200, exp=now - 600)
    assert cp._pki is not None
    key = serialization.load_pem_private_key(cp._pki.sa_key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    signed = f"{head}.{_b64(json.dumps(claims).encode())}"
    r, s = decode_dss_signature(key.sign(signed.encode(), ec.ECDSA(hashes.SHA256())))
    return f"{signed}.{_b64(r.to_bytes(32, 'big') + s.to_bytes(32, 'big'))}"


async def _status(target: str, token: str) -> None:
    client = WorkerClient(target, token=token)
    try:
        await client.get_status(10.0)
    finally:
        await client.close()


async def _refused(worker: WorkerHandle, token: str) -> str:
    worker.token = token
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.sleep_stub.Sleep(
            sleep_service_pb2.SleepRequest(task_id="x", level=types_pb2.SLEEP_LEVEL_OFFLOAD),
            metadata=worker.metadata,
        )
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    details = info.value.details() or ""
    assert not token or token not in details
    return details


async def test_only_the_operators_token_for_the_worker_audience(
    control_plane: ControlPlane,
    namespace: str,
    start_worker: StartWorker,
    lm_dir: Path,
    tmp_path: Path,
) -> None:
    cp, ns = control_plane, namespace
    for sa in ("operator", "worker", "intruder"):
        cp.kubectl("create", "serviceaccount", sa, "-n", ns)
    own = tmp_path / "worker-token"
    own.write_text(_token(cp, ns, "worker", audience=None))
    identity = f"system:serviceaccount:{ns}:operator"
    settings = TokenReviewSettings(
        operator_identity=identity,
        server=cp.server,
        token_file=own,
        ca_file=cp._pki.ca_cert if cp._pki else None,
        cache_ttl_s=30,
    )
    worker = await start_worker(lm_dir, "ar", "transformers", token_review=settings)

    # The worker's ServiceAccount may not create TokenReviews yet: it refuses, saying why.
    operator_token = _token(cp, ns, "operator")
    assert "HTTP 403" in await _refused(worker, operator_token)
    assert len(worker.server.reviewer.cache) == 0  # type: ignore[union-attr]
    cp.kubectl(
        "create", "clusterrolebinding", f"{ns}-worker-auth-delegator",
        "--clusterrole=system:auth-delegator", f"--serviceaccount={ns}:worker",
    )  # fmt: skip

    try:
        worker.token = operator_token
        assert (await worker.sleep(1)).ok
        assert (await worker.wake()).ok
        assert len(worker.server.reviewer.cache) == 1  # type: ignore[union-attr]

        assert "intruder" in await _refused(worker, _token(cp, ns, "intruder"))
        assert "did not authenticate" in await _refused(worker, _token(cp, ns, "operator", None))
        expired = await _refused(worker, _expired(cp, _token(cp, ns, "operator")))
        assert "expired" in expired, expired
        assert "metadata" in await _refused(worker, "")
        assert worker.server.worker.level == 0  # no refused order took effect
    finally:
        cp.kubectl("delete", "clusterrolebinding", f"{ns}-worker-auth-delegator")


def test_operator_hands_over_with_kubernetes_issued_tokens(
    cluster: Cluster, namespace: str, tiny_models: dict[str, Path], gpu_node: str, tmp_path: Path
) -> None:
    """The operator presents its ServiceAccount's token (audience omnistage-worker, as a
    projected volume would hold it); the stage pods carry no token Secret and check it."""
    cp, ns = cluster.cp, namespace
    for sa in ("operator", WORKER_SERVICE_ACCOUNT):
        cp.kubectl("create", "serviceaccount", sa, "-n", ns)
    binding = f"{ns}-omnistage-worker-reviews"
    cp.kubectl(
        "create", "clusterrolebinding", binding, "--clusterrole=system:auth-delegator",
        f"--serviceaccount={ns}:{WORKER_SERVICE_ACCOUNT}",
    )  # fmt: skip
    op = OperatorProcess(cp, ns, tmp_path)
    identity_file = tmp_path / "identity-token"
    identity_file.write_text(_token(cp, ns, "operator"))
    op.auth = ["--worker-identity-token-file", str(identity_file)]
    op.start()
    try:
        cluster.apply(stage_manifest("ar", "ar", tiny_models, gpu_node, state="Active"))
        cluster.apply(stage_manifest("sd", "sd", tiny_models, gpu_node, state="Asleep"))
        wait_for("ar Active", lambda: cluster.state("ar") == "Active", 180)
        wait_for("sd Asleep", lambda: cluster.state("sd") == "Asleep", 120)
        pod = cluster.pod("ar") or {}
        args = pod["spec"]["containers"][0]["args"]
        assert f"system:serviceaccount:{ns}:operator" in args and "--token-file" not in args
        assert pod["spec"]["serviceAccountName"] == WORKER_SERVICE_ACCOUNT
        secrets = cp.get_json("secrets", namespace=ns)["items"]
        assert "omnistage-worker-token" not in {s["metadata"]["name"] for s in secrets}

        # The hand-over, each order checked by TokenReview at the worker.
        cluster.patch_state("sd", "Active")
        wait_for("sd Active", lambda: cluster.state("sd") == "Active", 180)
        ar_ack = cluster.status("ar")["lastAck"]
        assert (ar_ack["op"], ar_ack["ok"]) == ("sleep", True)
        assert cluster.status("sd")["lastAck"]["op"] == "wake"
        # Another ServiceAccount's token for the right audience is refused by these workers.
        target = f"{pod['status']['podIP']}:{stage_port(pod)}"
        intruder = _token(cp, ns, WORKER_SERVICE_ACCOUNT)
        with pytest.raises(WorkerUnauthenticated, match=WORKER_SERVICE_ACCOUNT):
            asyncio.run(_status(target, intruder))
    finally:
        op.stop()
        cp.kubectl("delete", "clusterrolebinding", binding)
