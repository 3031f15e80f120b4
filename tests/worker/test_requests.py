"""Bad input gets the right gRPC status and a message naming the field; nothing is dropped."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from tests.worker.conftest import StartWorker, WorkerHandle


async def rpc_error(call: object) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call  # type: ignore[misc]
    return info.value


@pytest.mark.parametrize("level", [0, 3, 7])
async def test_sleep_level_invalid(lm_worker: WorkerHandle, level: int) -> None:
    err = await rpc_error(
        lm_worker.sleep_stub.Sleep(sleep_service_pb2.SleepRequest(task_id="t", level=level))  # type: ignore[arg-type]
    )
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "level" in (err.details() or "")
    assert (await lm_worker.status()).state == types_pb2.WORKER_STATE_ACTIVE


@pytest.mark.parametrize("task_id", ["", "   "])
async def test_empty_task_id(lm_worker: WorkerHandle, task_id: str) -> None:
    for call in (
        lm_worker.sleep_stub.Sleep(sleep_service_pb2.SleepRequest(task_id=task_id, level=1)),  # type: ignore[arg-type]
        lm_worker.sleep_stub.WakeUp(sleep_service_pb2.WakeUpRequest(task_id=task_id)),
    ):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "task_id" in (err.details() or "")


async def test_task_id_reused_for_another_request(lm_worker: WorkerHandle) -> None:
    assert (await lm_worker.sleep(1, task_id="same")).ok
    err = await rpc_error(lm_worker.wake(task_id="same"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "task_id 'same' was already used" in (err.details() or "")
    err = await rpc_error(lm_worker.sleep(2, task_id="same"))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"prompt": ""}, "prompt"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"max_new_tokens": 10**6}, "max_new_tokens"),
        ({"num_inference_steps": -2}, "num_inference_steps"),
        ({"guidance_scale": -1.0}, "guidance_scale"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
    ],
)
async def test_generate_invalid(
    lm_worker: WorkerHandle, fields: dict[str, object], named: str
) -> None:
    err = await rpc_error(lm_worker.generate(**fields))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (err.details() or "").startswith(named + ":")
    assert (await lm_worker.status()).inflight_requests == 0


async def test_diffusion_size_must_fit_the_vae(sd_worker: WorkerHandle) -> None:
    err = await rpc_error(sd_worker.generate(height=17, num_inference_steps=1))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "height" in (err.details() or "")
    ok = await sd_worker.generate(height=24, width=32, num_inference_steps=1)
    assert (ok.image.width, ok.image.height) == (32, 24)


@pytest.mark.parametrize("level", [1, 2])
async def test_generate_while_asleep(lm_worker: WorkerHandle, level: int) -> None:
    assert (await lm_worker.sleep(level)).ok
    err = await rpc_error(lm_worker.generate())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == f"worker is asleep (level {level})"
    assert (await lm_worker.wake()).ok
    assert (await lm_worker.generate(max_new_tokens=2)).text.token_ids


async def test_failed_load(start_worker: StartWorker, tmp_path: Path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    worker = await start_worker(empty, "ar", "transformers")
    status = await worker.status()
    assert status.state == types_pb2.WORKER_STATE_FAILED
    assert "loading" in status.error and str(empty) in status.error
    for call in (worker.sleep(1), worker.wake()):
        err = await rpc_error(call)
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert (err.details() or "").startswith("worker failed: loading")
    err = await rpc_error(worker.generate())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
