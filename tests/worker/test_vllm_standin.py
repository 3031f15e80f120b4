"""The vLLM runner against the STAND-IN engine (tests/fakevllm) on the simulated GPU (issue 9).

The worker runs in this process with ``tests/fakevllm`` on ``sys.path`` (so ``import vllm`` is
the stand-in); its engine core is a child process with its own record on the simulated GPU.
What is checked is physics the worker cannot fake: the worker process takes no context of its
own, the residual bound is what the engine holds asleep (measured at start), token ids are
identical after every wake, level 1 -> 2 is refused with the reason, a wake that does not fit
is refused with the need, and a wake that runs out of memory leaves the engine asleep.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import psutil
import pytest

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import DeviceSpec, VllmArgs
from omnistage_worker.runners.vllm_controller import VllmController
from omnistage_worker.runners.vllm_serve import LoopBridge, parse_serve_args, start_engine
from tests.fakegpu import model
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device
from tests.fakevllm.models import STANDIN_PATH, build_standin_model
from tests.worker.conftest import StartWorker, rpc_error, wait_for

STANDIN = str(STANDIN_PATH)
TOTAL = 4_000_000
CONTEXT = 100_000
GRAPHS = CONTEXT // 4  # the stand-in's CUDA graphs (enforce_eager=False)
WEIGHTS = 400_000
BUDGET = 1_600_000  # the stage's memory: gpu_memory_utilization 0.4


def build_model(directory: Path) -> Path:
    return build_standin_model(directory, WEIGHTS, vocab=256, tokenizer=False)


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    device = Device(uuid="GPU-v", total=TOTAL, reserve=0, context=CONTEXT, activation=0.1)
    fake = FakeGpu.create(tmp_path / "gpu", device)
    monkeypatch.setenv("OMNISTAGE_MEMORY_PROBE", "tests.fakegpu.probe:from_env")
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", str(fake.dir))
    monkeypatch.syspath_prepend(STANDIN)
    yield fake


@contextlib.contextmanager
def hog(gpu: FakeGpu, nbytes: int) -> Iterator[int]:
    """Another process holding ``nbytes`` on the simulated GPU (gone when it exits)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        gpu.publish(model.Proc(proc.pid, psutil.Process(proc.pid).create_time(), weights=nbytes))
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while proc.pid in gpu.live() and time.monotonic() < deadline:
        time.sleep(0.02)


def weights_bytes(model_dir: Path) -> int:
    return (model_dir / "model.safetensors").stat().st_size


async def start(start_worker: StartWorker, model_dir: Path, **engine: Any) -> Any:
    return await start_worker(
        model_dir, "ar", "vllm", device=DeviceSpec("cuda"),
        vllm=VllmArgs(memory_bytes=BUDGET, **engine),
    )  # fmt: skip


async def test_standin_stage_sleeps_and_wakes_with_measured_physics(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    model_dir = build_model(tmp_path / "m")
    weights = weights_bytes(model_dir)
    w = await start(start_worker, model_dir)
    st = await w.status()
    assert st.state == types_pb2.WORKER_STATE_ACTIVE
    live = gpu.live()
    assert os.getpid() not in live  # the worker takes no context of its own
    (engine,) = live.values()
    held_asleep = CONTEXT + GRAPHS
    assert engine.used == BUDGET - int(weights * 0.1)  # all of its budget but the peak
    active = engine.used
    assert st.used_bytes == active and active > weights
    first = list((await w.generate(prompt="hello", max_new_tokens=8)).text.token_ids)
    assert len(first) == 8

    for level in (1, 2, 1):
        ack = await w.sleep(level)
        assert ack.ok, ack.error
        # The residual is what the engine holds asleep, measured at start: context + graphs.
        assert ack.used_after_bytes == held_asleep
        assert gpu.snapshot().used_total == held_asleep
        wake = await w.wake()
        assert wake.ok, wake.error
        again = list((await w.generate(prompt="hello", max_new_tokens=8)).text.token_ids)
        assert again == first, f"token ids changed after a level-{level} wake"

    # 1 -> 2 while asleep is refused, with the reason.
    assert (await w.sleep(1)).ok
    err = await rpc_error(w.sleep(2))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "wake it first" in (err.details() or "")


async def test_sleep_drains_a_request_in_flight_instead_of_aborting_it(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, build_model(tmp_path / "m"))
    reference = list((await w.generate(prompt="hi", max_new_tokens=4)).text.token_ids)
    gpu.set_faults(slow_serving_s=1.0)  # every request of the engine takes a second
    request = asyncio.ensure_future(w.generate(prompt="hi", max_new_tokens=4))
    await wait_for(lambda: _inflight(w), within=10, what="the request in flight")
    ack = await w.sleep(1)
    assert ack.ok, ack.error
    assert ack.drain_duration.ToTimedelta().total_seconds() > 0.3  # it waited for the request
    assert list((await request).text.token_ids) == reference  # which finished, not aborted
    gpu.clear_faults()


async def _inflight(w: Any) -> bool:
    return int((await w.status()).inflight_requests) > 0


async def test_wake_that_does_not_fit_is_refused_with_the_need(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, build_model(tmp_path / "m"), enforce_eager=True)
    assert (await w.sleep(1)).ok
    with hog(gpu, gpu.snapshot().free - 1000):
        ack = await w.wake()
        assert not ack.ok and "not enough free device memory" in ack.error
        assert (await w.status()).state == types_pb2.WORKER_STATE_ASLEEP
    ack = await w.wake()
    assert ack.ok, ack.error


def _engine(model_dir: Path, utilization: float, enforce_eager: bool = False) -> Any:
    """The stand-in's AsyncLLM built the way the worker builds it (vLLM's serve flags)."""
    argv = ["--model", str(model_dir), "--enable-sleep-mode", "--skip-tokenizer-init",
            "--gpu-memory-utilization", str(utilization)]  # fmt: skip
    if enforce_eager:
        argv.append("--enforce-eager")
    return start_engine(parse_serve_args(argv))


async def test_out_of_memory_wake_leaves_the_engine_asleep(gpu: FakeGpu, tmp_path: Path) -> None:
    """The controller puts a half-woken engine back to sleep (weights mapped, KV OOM)."""
    model_dir = build_model(tmp_path / "m")
    engine = _engine(model_dir, BUDGET / TOTAL, enforce_eager=True)
    try:
        ctl = VllmController(engine, LoopBridge(), weights_bytes(model_dir))
        await asyncio.to_thread(ctl.sleep, 1)
        room = gpu.snapshot().free - weights_bytes(model_dir) - 1000  # weights fit, KV not
        with hog(gpu, room):
            with pytest.raises(Exception, match="OutOfMemory"):
                await asyncio.to_thread(ctl.wake)
            assert ctl.level == 1
            state = gpu.live()[engine.engine_pid]
            assert state.weights == 0 and state.pool == 0  # back asleep: nothing mapped
        await asyncio.to_thread(ctl.wake)
        assert gpu.live()[engine.engine_pid].weights > 0
    finally:
        engine.shutdown()


def test_standin_refuses_a_start_the_free_memory_does_not_cover(
    gpu: FakeGpu, tmp_path: Path
) -> None:
    """vLLM takes its memory while it starts: a second engine of 60% does not start."""
    model_dir = build_model(tmp_path / "m")
    first = _engine(model_dir, 0.6)
    try:
        with pytest.raises(Exception, match="less than desired GPU memory utilization"):
            _engine(model_dir, 0.6)
    finally:
        first.shutdown()


async def test_standin_app_ignores_best_of_as_vllms_request_model_does(
    gpu: FakeGpu, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's ``CompletionRequest`` (0.24) has no ``best_of``; its base model allows extra
    fields, logs them as ignored and serves the request without them. The stand-in's bare app
    (no worker front) does the same: the answer equals the one without the field."""
    from vllm.entrypoints.openai import api_server  # the stand-in (gpu puts it on the path)

    model_dir = build_model(tmp_path / "m")
    args = parse_serve_args(["--model", str(model_dir), "--enable-sleep-mode",
                             "--skip-tokenizer-init", "--enforce-eager",
                             "--gpu-memory-utilization", str(BUDGET / TOTAL)])  # fmt: skip
    engine = start_engine(args)
    try:
        app = api_server.build_app(args)
        await api_server.init_app_state(engine, app.state, args)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://stand-in") as c:
            ask = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0}
            plain = await c.post("/v1/completions", json=ask)
            with caplog.at_level("WARNING"):
                extra = await c.post("/v1/completions", json={**ask, "best_of": 3})
        assert plain.status_code == 200, plain.text
        assert extra.status_code == 200, extra.text
        assert [ch["text"] for ch in extra.json()["choices"]] == [
            ch["text"] for ch in plain.json()["choices"]
        ]
        assert extra.json()["usage"]["completion_tokens"] == 3
        assert "ignored: {'best_of'}" in caplog.text
    finally:
        engine.shutdown()


async def test_fast_wake_extension_reaches_the_engine_and_the_flag_turns_it_off(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    """The engine gets the worker extension (issue 23) and imports it as vLLM's worker does; it
    answers its report over ``collective_rpc`` (not installed: the stand-in has no
    ``CuMemAllocator``). ``--no-vllm-fast-wake`` leaves it out. The kept host copy counts in
    ``host_bytes`` while awake, until a level-2 sleep gives it back."""
    from omnistage_worker.cli import build_parser, config_from_args
    from omnistage_worker.runners.vllm_serve import FAST_WAKE_EXTENSION

    model_dir = build_model(tmp_path / "m")
    w = await start(start_worker, model_dir)
    runner: Any = w.server.worker.runner
    assert FAST_WAKE_EXTENSION in runner.serve_argv(TOTAL, TOTAL)
    assert runner.engine.vllm_config.parallel_config.worker_extension_cls == FAST_WAKE_EXTENSION
    report = runner.wake_report
    assert report is not None and report["installed"] is False
    assert "cumem allocator cannot be imported" in report["reason"]
    ctl = runner.build_controller()
    weights = weights_bytes(model_dir)
    assert ctl.host_bytes() == weights  # the calibration's level-1 sleep kept the host copy
    await asyncio.to_thread(ctl.sleep, 2)
    await asyncio.to_thread(ctl.wake)
    assert ctl.host_bytes() == 0

    flags = [
        "--runner=ar",
        "--backend=vllm",
        f"--model={model_dir}",
        "--device=cuda",
        "--no-vllm-fast-wake",
    ]
    config = config_from_args(build_parser({}).parse_args(flags))
    assert config.vllm.fast_wake is False
    off = VllmController(None, LoopBridge(), weights, keeps_host_copy=config.vllm.fast_wake)
    assert off.host_bytes() == 0
    argv = runner.serve_argv(TOTAL, TOTAL)
    runner.config = config
    assert "--worker-extension-cls" not in runner.serve_argv(TOTAL, TOTAL) != argv
