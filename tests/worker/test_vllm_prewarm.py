"""A vLLM stage started asleep is pre-warmed (issue 23): vLLM imported, nothing on the device.

Against the STAND-IN engine (``tests/fakevllm``) on the simulated GPU, the worker in this
process. Started with ``--initial-state asleep --sleep-level 2`` the worker checks vLLM's flags
and imports vLLM, but no engine process exists and the device holds nothing of the stage; its
first wake starts the engine (then a calibration, as an Active start does) and the Ack's
figures are the engine's. The residual bound of the sleeps after it is what that engine holds
asleep (with no slack, a bound left at the pre-warmed 0 would fail the first sleep). A first
wake whose engine cannot start leaves nothing behind: the stage is asleep at level 2 again and
a later wake starts it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import ConfigError, DeviceSpec, VllmArgs, WorkerConfig
from tests.fakegpu.device import FakeGpu
from tests.worker.conftest import StartWorker
from tests.worker.test_vllm_standin import BUDGET, CONTEXT, GRAPHS, build_model, gpu, weights_bytes

__all__ = ["gpu"]  # the simulated GPU fixture, shared with the stand-in's tests

pytestmark = [pytest.mark.timeout(300)]


async def start_prewarmed(start_worker: StartWorker, model_dir: Path) -> Any:
    return await start_worker(
        model_dir, "ar", "vllm", device=DeviceSpec("cuda"), initial_state="asleep",
        sleep_level=2, residual_slack=0, vllm=VllmArgs(memory_bytes=BUDGET),
    )  # fmt: skip


async def test_prewarmed_stage_holds_nothing_until_its_first_wake_starts_the_engine(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    model_dir = build_model(tmp_path / "m")
    w = await start_prewarmed(start_worker, model_dir)
    st = await w.status()
    assert st.state == types_pb2.WORKER_STATE_ASLEEP and st.level == 2
    assert gpu.live() == {} and gpu.snapshot().used_total == 0  # no engine, no context
    runner: Any = w.server.worker.runner
    assert runner.engine is None and runner.fields  # vLLM's request models imported

    ack = await w.wake()
    assert ack.ok, ack.error
    live = gpu.live()
    assert os.getpid() not in live  # the worker still takes no context of its own
    (engine,) = live.values()
    assert engine.used == BUDGET - int(weights_bytes(model_dir) * 0.1)
    assert ack.used_after_bytes == engine.used
    assert ack.bytes_moved == weights_bytes(model_dir)
    first = list((await w.generate(prompt="hello", max_new_tokens=8)).text.token_ids)
    assert len(first) == 8

    for level in (1, 2):
        ack = await w.sleep(level)
        assert ack.ok, ack.error  # the bound is the started engine's residual, not 0
        assert ack.used_after_bytes == CONTEXT + GRAPHS
        assert (await w.wake()).ok
        again = list((await w.generate(prompt="hello", max_new_tokens=8)).text.token_ids)
        assert again == first, f"token ids changed after a level-{level} wake"


async def test_a_first_wake_whose_engine_fails_to_start_leaves_it_asleep_at_level_2(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    model_dir = build_model(tmp_path / "m")
    w = await start_prewarmed(start_worker, model_dir)
    config = model_dir / "config.json"
    good = config.read_text()
    config.write_text("{ not json")  # the engine core cannot read its model
    ack = await w.wake()
    assert not ack.ok and "wake from level 2 failed" in ack.error
    st = await w.status()
    assert st.state == types_pb2.WORKER_STATE_ASLEEP and st.level == 2
    assert gpu.live() == {} and gpu.snapshot().used_total == 0  # nothing left running
    config.write_text(good)
    ack = await w.wake()
    assert ack.ok, ack.error
    assert (await w.status()).state == types_pb2.WORKER_STATE_ACTIVE


def test_a_vllm_stage_starts_asleep_only_at_level_2(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "m")
    with pytest.raises(ConfigError) as err:  # refused as the configuration is made
        WorkerConfig(
            runner="ar", backend="vllm", model=model_dir, device=DeviceSpec("cuda"),
            initial_state="asleep", sleep_level=1,
        )  # fmt: skip
    assert err.value.flag == "--sleep-level" and "pre-warmed at level 2" in str(err.value)
