"""The operator's worker client over TLS: a real worker with a certificate the test issues.

The operator dials pod IPs, which no certificate names; it verifies the worker's certificate
against the stage's Service name (``<stage>-worker.<namespace>.svc``) instead.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc
from omnistage_operator.decisions.handover import WorkerUnavailable
from omnistage_operator.k8s.worker_client import WorkerClient
from tests.worker.conftest import StartWorker

SERVICE_NAME = "tiny-llama-worker.demo.svc"
TOKEN = "tls-test-token"


def issue(directory: Path, dns_name: str) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for ``dns_name`` signed by it (openssl)."""
    ca_key, ca_crt = directory / "ca.key", directory / "ca.crt"
    key, csr, crt = directory / "tls.key", directory / "tls.csr", directory / "tls.crt"
    ext = directory / "ext.cnf"
    ext.write_text(f"subjectAltName=DNS:{dns_name}\nextendedKeyUsage=serverAuth\n")

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout",
            str(ca_key), "-out", str(ca_crt), "-subj", "/CN=omnistage-test-ca")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr),
            "-subj", f"/CN={dns_name}")  # fmt: skip
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca_crt), "-CAkey", str(ca_key),
            "-CAcreateserial", "-days", "1", "-out", str(crt), "-extfile", str(ext))  # fmt: skip
    return ca_crt, crt, key


async def test_operator_client_verifies_the_service_name_over_tls(
    start_worker: StartWorker, lm_dir: Path, tmp_path: Path
) -> None:
    ca, crt, key = issue(tmp_path, SERVICE_NAME)
    worker = await start_worker(lm_dir, "ar", "transformers", tls_cert=crt, tls_key=key,
                                token=TOKEN)  # fmt: skip
    target = f"127.0.0.1:{worker.server.port}"

    good = WorkerClient(target, token=TOKEN, ca_pem=ca.read_bytes(), server_name=SERVICE_NAME)
    try:
        report = await good.get_status(10.0)
        assert report.weights_bytes > 0
        ack = await good.sleep(1, "tls-sleep-1", 30.0)
        assert ack.ok and ack.op == "sleep"
        assert (await good.wake("tls-wake-1", 30.0)).ok
    finally:
        await good.close()

    failures = {
        "another name": WorkerClient(
            target, token=TOKEN, ca_pem=ca.read_bytes(), server_name="other-worker.demo.svc"
        ),
        "plaintext": WorkerClient(target, token=TOKEN),
        "wrong token": WorkerClient(
            target, token="wrong", ca_pem=ca.read_bytes(), server_name=SERVICE_NAME
        ),
    }
    for what, client in failures.items():
        try:
            with pytest.raises(WorkerUnavailable) as info:
                await client.get_status(5.0)
            if what == "wrong token":
                assert "UNAUTHENTICATED" in str(info.value)
            assert TOKEN not in str(info.value)
        finally:
            await client.close()


async def test_plaintext_health_port_beside_a_tls_only_worker(
    start_worker: StartWorker, lm_dir: Path, tmp_path: Path
) -> None:
    """The kubelet's gRPC probe cannot speak TLS: ``--health-port`` answers it in plaintext with
    the worker's real health, while SleepService stays on the TLS port only."""
    ca, crt, key = issue(tmp_path, SERVICE_NAME)
    worker = await start_worker(lm_dir, "ar", "transformers", tls_cert=crt, tls_key=key,
                                token=TOKEN, health_port=0)  # fmt: skip
    assert worker.server.health_port not in (0, worker.server.port)
    health_target = f"127.0.0.1:{worker.server.health_port}"
    async with grpc.aio.insecure_channel(health_target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "omnistage.worker.v1.SleepService"):
            answer = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert answer.status == health_pb2.HealthCheckResponse.SERVING, service
        # Only health there: the control channel is not reachable without TLS.
        sleep = sleep_service_pb2_grpc.SleepServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=5)
        assert info.value.code() is grpc.StatusCode.UNIMPLEMENTED
    # A plaintext probe on the TLS port (what the kubelet did before) fails.
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
        assert info.value.code() is grpc.StatusCode.UNAVAILABLE
    client = WorkerClient(
        f"127.0.0.1:{worker.server.port}", token=TOKEN, ca_pem=ca.read_bytes(),
        server_name=SERVICE_NAME,
    )  # fmt: skip
    try:
        assert (await client.sleep(1, "tls-health-sleep", 30.0)).ok
    finally:
        await client.close()
