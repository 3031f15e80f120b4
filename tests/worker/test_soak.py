"""A soak of sleep/wake cycles: the worker process's RSS must not grow with the cycles.

The worker runs as its own process (the real ``omnistage-worker`` command), so its RSS is
measured alone, not mixed with the test process's other workers.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import psutil
import pytest

from omnistage.worker.v1 import types_pb2
from tests.worker.cli_process import Subprocess
from tests.worker.conftest import WorkerHandle, wait_for
from tests.worker.tiny_models import build_causal_lm

CYCLES = 24
WARMUP = 4
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def soak_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # About 16 MB of float32 weights, so one leaked copy is far above the RSS noise.
    return build_causal_lm(
        tmp_path_factory.mktemp("models") / "soak-llama",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
    )


@pytest.mark.slow
async def test_soak_rss_bounded(soak_lm_dir: Path, tmp_path: Path) -> None:
    """Bound: RSS after the last cycle is within half a weight copy of RSS after the warm-up.

    So not one leaked copy of the weights over 20 cycles (measured: well under 1 MiB).
    """
    proc = Subprocess(
        ["--runner", "ar", "--backend", "transformers", "--model", str(soak_lm_dir),
         "--host", "127.0.0.1", "--port", "0"],
        tmp_path / "soak.log",
    )  # fmt: skip
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{proc.port()}")
    worker = WorkerHandle(None, channel)  # type: ignore[arg-type]
    try:

        async def active() -> bool:
            return (await worker.status()).state == types_pb2.WORKER_STATE_ACTIVE

        await wait_for(active, within=60, what="the worker to load")
        weights = (await worker.status()).weights_bytes
        assert weights > 12 * MIB
        reference = (await worker.generate(prompt="the cat", max_new_tokens=4)).text.token_ids
        rss = psutil.Process(proc.proc.pid).memory_info
        rss_after_warmup = 0
        for cycle in range(CYCLES):
            level = 1 + cycle % 2
            slept = await worker.sleep(level, task_id=f"soak-sleep-{cycle}")
            assert slept.ok, slept.error
            assert slept.used_after_bytes == 0
            woke = await worker.wake(task_id=f"soak-wake-{cycle}")
            assert woke.ok, woke.error
            assert woke.used_after_bytes == slept.used_before_bytes
            output = (await worker.generate(prompt="the cat", max_new_tokens=4)).text.token_ids
            assert output == reference, f"cycle {cycle}: output changed"
            if cycle == WARMUP - 1:
                rss_after_warmup = rss().rss
        growth = rss().rss - rss_after_warmup
        bound = weights // 2
        assert growth <= bound, (
            f"worker RSS grew {growth / MIB:.1f} MiB over {CYCLES - WARMUP} cycles "
            f"(bound {bound / MIB:.1f} MiB)"
        )
    finally:
        await channel.close()
        proc.stop()
