"""Bearer token on SleepService; health follows the state; reflection is open."""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc
from omnistage_worker.serving.auth import token_matches
from omnistage_worker.serving.health import INFERENCE_SERVICE, OVERALL, SLEEP_SERVICE
from tests.worker.conftest import StartWorker, WorkerHandle

TOKEN = "s3cret-token-value"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_token_matches() -> None:
    assert token_matches(f"Bearer {TOKEN}", TOKEN)
    assert token_matches(f"bearer {TOKEN}", TOKEN)
    assert not token_matches(None, TOKEN)
    assert not token_matches(TOKEN, TOKEN)
    assert not token_matches(f"Basic {TOKEN}", TOKEN)
    assert not token_matches(f"Bearer {TOKEN}x", TOKEN)
    assert not token_matches("Bearer ", TOKEN)


@pytest.fixture
async def secured(start_worker: StartWorker, lm_dir: Path) -> WorkerHandle:
    return await start_worker(lm_dir, "ar", "transformers", token=TOKEN)


@pytest.mark.parametrize(
    "metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]
)
async def test_sleep_service_needs_the_token(
    secured: WorkerHandle, metadata: tuple[tuple[str, str], ...]
) -> None:
    stub = secured.sleep_stub
    for call in (
        stub.Sleep(sleep_service_pb2.SleepRequest(task_id="a", level=1), metadata=metadata),  # type: ignore[arg-type]
        stub.WakeUp(sleep_service_pb2.WakeUpRequest(task_id="b"), metadata=metadata),
        stub.GetStatus(sleep_service_pb2.GetStatusRequest(), metadata=metadata),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await call
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert TOKEN not in (info.value.details() or "")
    # Nothing happened: the worker is still awake.
    assert secured.server.worker.level == 0


async def test_right_token_and_open_services(
    secured: WorkerHandle, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    assert (await secured.sleep(1)).ok  # the handle sends the right token
    assert (await secured.wake()).ok
    assert (await secured.generate(max_new_tokens=2)).text.token_ids  # inference is open
    assert await secured.health(OVERALL) == SERVING  # health is open
    stub = reflection_pb2_grpc.ServerReflectionStub(secured.channel)
    responses = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = set()
    async for response in responses:
        names = {s.name for s in response.list_services_response.service}
        break
    assert {SLEEP_SERVICE, INFERENCE_SERVICE, "grpc.health.v1.Health"} <= names
    assert TOKEN not in caplog.text


async def test_health_follows_state(lm_worker: WorkerHandle) -> None:
    async def all_health() -> tuple[int, int, int]:
        return (
            await lm_worker.health(OVERALL),
            await lm_worker.health(SLEEP_SERVICE),
            await lm_worker.health(INFERENCE_SERVICE),
        )

    assert await all_health() == (SERVING, SERVING, SERVING)
    assert (await lm_worker.sleep(1)).ok
    assert await all_health() == (SERVING, SERVING, NOT_SERVING)
    assert (await lm_worker.sleep(2)).ok
    assert await all_health() == (SERVING, SERVING, NOT_SERVING)
    assert (await lm_worker.wake()).ok
    assert await all_health() == (SERVING, SERVING, SERVING)


async def test_health_of_failed_and_unknown(start_worker: StartWorker, tmp_path: Path) -> None:
    worker = await start_worker(tmp_path, "ar", "transformers")  # no model there: FAILED
    assert await worker.health(OVERALL) == NOT_SERVING
    assert await worker.health(INFERENCE_SERVICE) == NOT_SERVING
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.health("no.such.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_tls(start_worker: StartWorker, lm_dir: Path, tmp_path: Path) -> None:
    cert, key = make_self_signed(tmp_path)
    worker = await start_worker(lm_dir, "ar", "transformers", tls_cert=cert, tls_key=key)
    with pytest.raises(grpc.aio.AioRpcError) as info:  # the fixture's channel is plaintext
        await worker.status()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    async with grpc.aio.secure_channel(f"localhost:{worker.server.port}", creds) as channel:
        stub = sleep_service_pb2_grpc.SleepServiceStub(channel)
        status = await stub.GetStatus(sleep_service_pb2.GetStatusRequest())
        assert status.weights_bytes > 0


def make_self_signed(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost, made with the openssl command."""
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost",
        ],
        check=True,
        capture_output=True,
    )
    return cert, key
