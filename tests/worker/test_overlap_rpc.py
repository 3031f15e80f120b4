"""The overlapped hand-over's RPCs over real gRPC (issue 23): SleepStream, a WakeUp under
``claim_limit_bytes`` and RaiseClaimLimit, with their refusals.

On the CPU the engine's flat buffer is one allocation, so a wake under a limit claims it whole:
it waits until the limit covers the model, which is what these tests drive. The piece-by-piece
overlap itself is tested in ``tests/unit/test_overlapped_wake.py`` and measured on the GPU by
``bench/overlap.py``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import sleep_service_pb2, types_pb2
from omnistage_worker.engine.handoff import HANDOFF_DIR_ENV, Sender
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device, GiB
from tests.worker.conftest import StartWorker, WorkerHandle, new_task_id, rpc_error, wait_for

ACTIVE = types_pb2.WORKER_STATE_ACTIVE
WAKING = types_pb2.WORKER_STATE_WAKING
INVALID = grpc.StatusCode.INVALID_ARGUMENT


async def raise_limit(
    worker: WorkerHandle, task_id: str, limit: int
) -> sleep_service_pb2.RaiseClaimLimitResponse:
    response: sleep_service_pb2.RaiseClaimLimitResponse = await worker.sleep_stub.RaiseClaimLimit(
        sleep_service_pb2.RaiseClaimLimitRequest(task_id=task_id, claim_limit_bytes=limit),
        metadata=worker.metadata,
    )
    return response


async def gated_wake(worker: WorkerHandle, limit: int) -> tuple[str, asyncio.Future[Any]]:
    """A WakeUp under ``limit`` sent, once the worker holds it waiting under its gate."""
    task_id = new_task_id()
    waking = asyncio.ensure_future(
        worker.sleep_stub.WakeUp(
            sleep_service_pb2.WakeUpRequest(task_id=task_id, claim_limit_bytes=limit),
            metadata=worker.metadata,
        )
    )

    async def gated() -> bool:
        return (await raise_limit(worker, task_id, limit)).running

    await wait_for(gated, what="the wake to wait under its limit")
    return task_id, waking


async def stream_sleep(
    worker: WorkerHandle, handoff_channel: str = "", **fields: object
) -> list[sleep_service_pb2.SleepStreamResponse]:
    request = sleep_service_pb2.SleepStreamRequest(
        sleep=sleep_service_pb2.SleepRequest(**fields),  # type: ignore[arg-type]
        handoff_channel=handoff_channel,
    )
    return [m async for m in worker.sleep_stub.SleepStream(request, metadata=worker.metadata)]


async def test_a_streamed_sleep_ends_with_its_ack(lm_worker: WorkerHandle) -> None:
    before = await lm_worker.status()
    messages = await stream_sleep(lm_worker, task_id="s1", level=1)
    assert messages[-1].WhichOneof("event") == "ack"
    ack = messages[-1].ack
    assert ack.ok and ack.task_id == "s1" and ack.freed_bytes > 0
    assert before.claim_limits, "one device, the weight engine: it can take part"
    first, *pieces = [m.released for m in messages[:-1]]
    # measured before the sleep gave anything back: the device's free memory then
    assert first.released_bytes == 0 and first.used_bytes == before.used_bytes
    assert first.HasField("device_free_bytes")
    assert first.device_free_bytes == before.free_bytes
    released = [m.released_bytes for m in pieces]
    assert released == sorted(released) and all(0 < r <= before.used_bytes for r in released)
    assert not any(m.HasField("device_free_bytes") for m in pieces)
    # The Ack is the Sleep's: a repeat of its task id over Sleep replays it.
    assert (await lm_worker.sleep(1, task_id="s1")).replayed


async def test_a_wake_under_a_limit_waits_for_its_raise(lm_worker: WorkerHandle) -> None:
    reference = list((await lm_worker.generate(max_new_tokens=4)).text.token_ids)
    assert (await lm_worker.sleep(1)).ok
    asleep = await lm_worker.status()
    task_id, waking = await gated_wake(lm_worker, 1)
    held = await raise_limit(lm_worker, task_id, 1)
    assert held.claimed_bytes == asleep.used_bytes  # nothing taken beyond what it held asleep
    assert held.claim_limit_bytes == 1
    assert (await lm_worker.status()).state == WAKING and not waking.done()

    err = await rpc_error(raise_limit(lm_worker, task_id, 0))
    assert err.code() == INVALID and err.details() == "claim_limit_bytes: 0 must be above 0"
    need = asleep.active_footprint_bytes  # what it held awake, measured
    raised = await raise_limit(lm_worker, task_id, need)
    assert raised.running and raised.claim_limit_bytes == need
    ack = (await waking).ack
    assert ack.ok and ack.state == ACTIVE and ack.used_after_bytes <= need
    assert list((await lm_worker.generate(max_new_tokens=4)).text.token_ids) == reference
    # The wake is over: a raise now changes nothing and says so.
    assert not (await raise_limit(lm_worker, task_id, need + 1)).running


async def test_a_lower_limit_and_bad_fields_are_refused(lm_worker: WorkerHandle) -> None:
    err = await rpc_error(
        lm_worker.sleep_stub.WakeUp(
            sleep_service_pb2.WakeUpRequest(task_id="w", claim_limit_bytes=-1),
            metadata=lm_worker.metadata,
        )
    )
    assert err.code() == INVALID and err.details() == "claim_limit_bytes: -1 is negative"
    err = await rpc_error(stream_sleep(lm_worker, task_id="s", level=1, components=["model"]))
    assert err.code() == INVALID and err.details().startswith("sleep.components:")
    err = await rpc_error(
        lm_worker.sleep_stub.SleepStream(
            sleep_service_pb2.SleepStreamRequest(), metadata=lm_worker.metadata
        ).read()
    )
    assert err.code() == INVALID and err.details() == "sleep: required"
    err = await rpc_error(stream_sleep(lm_worker, task_id="", level=1))
    assert err.code() == INVALID and err.details().startswith("task_id")
    assert (await lm_worker.status()).state == ACTIVE  # nothing changed

    assert (await lm_worker.sleep(1)).ok
    task_id, waking = await gated_wake(lm_worker, 10)
    err = await rpc_error(raise_limit(lm_worker, task_id, 9))
    assert err.code() == INVALID
    assert err.details() == "claim_limit_bytes: claim limit 9 is below the current 10"
    assert (await raise_limit(lm_worker, task_id, 1 << 40)).running
    assert (await waking).ack.ok


async def test_a_stage_on_two_devices_refuses_a_limit(
    start_worker: StartWorker, lm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    worker = await start_worker(lm_dir, "ar", "transformers", gpus=2)
    assert (await worker.sleep(1)).ok
    assert not (await worker.status()).claim_limits, "it says so ahead: no overlapped hand-over"
    err = await rpc_error(
        worker.sleep_stub.WakeUp(
            sleep_service_pb2.WakeUpRequest(task_id="w", claim_limit_bytes=1 << 40),
            metadata=worker.metadata,
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == (
        "claim_limit_bytes: the stage holds 2 devices; one limit covers one device"
    )
    assert (await worker.wake(task_id="w")).ok  # the refused id was not remembered
    # Nor does it hand its pieces over: a piece goes to a wake on the same, single device.
    monkeypatch.setenv(HANDOFF_DIR_ENV, "/tmp")
    err = await rpc_error(stream_sleep(worker, handoff_channel="c", task_id="s", level=1))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("handoff_channel: the stage holds 2 devices")


async def test_a_raise_before_the_wake_begins_is_kept_for_it(lm_worker: WorkerHandle) -> None:
    """The caller's raise may reach the worker before its WakeUp does (or while it waits for
    the worker's lock): the wake starts from it instead of waiting for one that never comes."""
    assert (await lm_worker.sleep(1)).ok
    need = (await lm_worker.status()).active_footprint_bytes
    assert not (await raise_limit(lm_worker, "early", need)).running
    woke = await lm_worker.sleep_stub.WakeUp(
        sleep_service_pb2.WakeUpRequest(task_id="early", claim_limit_bytes=1),
        metadata=lm_worker.metadata,
        timeout=20,  # a wake left at its own limit of 1 byte would give up after 5 s
    )
    assert woke.ack.ok and woke.ack.state == ACTIVE


async def test_components_asleep_refuse_a_limit(sd_worker: WorkerHandle) -> None:
    assert (await sd_worker.sleep(1, components=("vae",))).ok
    err = await rpc_error(
        sd_worker.sleep_stub.WakeUp(
            sleep_service_pb2.WakeUpRequest(task_id="w", claim_limit_bytes=1 << 40),
            metadata=sd_worker.metadata,
        )
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("claim_limit_bytes: the worker is Active with components")
    assert (await sd_worker.wake(task_id="w")).ok


async def test_an_asleep_pipeline_wakes_whole_under_a_limit(sd_worker: WorkerHandle) -> None:
    """Every component of an asleep pipeline is asleep: that is a whole wake, not the Active
    worker's components, and it takes a limit like any other."""
    assert (await sd_worker.sleep(1)).ok
    status = await sd_worker.status()
    task_id, waking = await gated_wake(sd_worker, max(1, status.used_bytes))
    assert not waking.done()  # held at its limit: the pipeline's weights do not fit under it
    await raise_limit(sd_worker, task_id, 1 << 40)
    woke = await waking
    assert woke.ack.ok and woke.ack.state == ACTIVE


async def test_a_stream_begun_while_a_request_runs_gives_no_room_beside(
    start_worker: StartWorker, lm_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room beside the sleeper is what a wake may take before anything is released: while a
    request still runs (the sleep drains it first) its activations may need that room, so the
    first report leaves it out (the wake beside waits for what the sleep releases)."""
    gpu = FakeGpu.create(tmp_path / "gpu", Device(uuid="GPU-drain", index=0, total=GiB))
    monkeypatch.setenv("OMNISTAGE_MEMORY_PROBE", "tests.fakegpu.probe:from_env")
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", str(gpu.dir))
    worker = await start_worker(lm_dir, "ar", "transformers")
    gpu.set_faults(slow_serving_s=1.0)  # the request holds the engine for a second
    request = asyncio.ensure_future(worker.generate(prompt="the cat", max_new_tokens=2))
    await wait_for(lambda: _inflight(worker), what="the request in flight")
    messages = await stream_sleep(worker, task_id="s-drain", level=1)
    await request
    ack = messages[-1].ack
    assert ack.ok and ack.drain_duration.ToNanoseconds() > 0 and ack.freed_bytes > 0
    first = messages[0].released
    assert first.released_bytes == 0 and not first.HasField("device_free_bytes")


async def _inflight(worker: WorkerHandle) -> bool:
    return (await worker.status()).inflight_requests > 0


async def test_a_handoff_channel_lives_for_its_wake_and_is_refused_where_it_cannot(
    lm_worker: WorkerHandle, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The channel is opened by the wake that names it and closed with it; a piece sent to it
    that the wake does not take (on the CPU the flat buffer is claimed whole, no piece) is
    freed before the wake makes its own memory, and whatever is named wrong is refused."""
    monkeypatch.delenv(HANDOFF_DIR_ENV, raising=False)
    assert not (await lm_worker.status()).handoff
    err = await rpc_error(stream_sleep(lm_worker, task_id="s", level=1, handoff_channel="c"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("handoff_channel: the worker has no hand-off directory")
    assert (await lm_worker.status()).state == ACTIVE  # refused before anything changed

    monkeypatch.setenv(HANDOFF_DIR_ENV, "/" + "d" * 40)  # too long for the longest name's socket
    assert not (await lm_worker.status()).handoff
    tmp_path = Path(tempfile.mkdtemp(prefix="ho", dir="/tmp"))
    monkeypatch.setenv(HANDOFF_DIR_ENV, str(tmp_path))
    assert (await lm_worker.status()).handoff
    assert (await lm_worker.sleep(1)).ok
    for limit, channel, why in (
        (0, "c", "handoff_channel: only for a wake under a claim limit"),
        (1, "../x", "handoff_channel: '../x' is not"),
    ):
        request = sleep_service_pb2.WakeUpRequest(
            task_id=new_task_id(), claim_limit_bytes=limit, handoff_channel=channel
        )
        err = await rpc_error(lm_worker.sleep_stub.WakeUp(request, metadata=lm_worker.metadata))
        assert err.code() == INVALID and err.details().startswith(why)

    task_id = new_task_id()
    waking = asyncio.ensure_future(
        lm_worker.sleep_stub.WakeUp(
            sleep_service_pb2.WakeUpRequest(
                task_id=task_id, claim_limit_bytes=1, handoff_channel="wake-c"
            ),
            metadata=lm_worker.metadata,
        )
    )
    socket_path = tmp_path / "wake-c.sock"

    async def listening() -> bool:
        return socket_path.exists() and (await raise_limit(lm_worker, task_id, 1)).running

    await wait_for(listening, what="the wake to listen on its channel under its limit")
    sender = Sender(socket_path)
    read_end, piece = os.pipe()  # a piece: it lives while any descriptor of it is open
    assert sender.send(piece, 4096)
    os.close(piece)
    assert (await raise_limit(lm_worker, task_id, 1 << 40)).running
    assert (await waking).ack.ok
    assert os.read(read_end, 1) == b"", "the unused piece was freed (its last reference closed)"
    os.close(read_end)
    assert not socket_path.exists()
    late = os.dup(0)
    assert not sender.send(late, 4096)  # the channel closed with its wake
    os.close(late)
    sender.close()
    shutil.rmtree(tmp_path)
