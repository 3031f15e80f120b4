"""A soak of sleep/wake cycles: process RSS must not grow with the number of cycles."""

from __future__ import annotations

import gc
from pathlib import Path

import psutil
import pytest

from tests.worker.conftest import StartWorker
from tests.worker.tiny_models import build_causal_lm

CYCLES = 24
MIB = 1024 * 1024


@pytest.fixture(scope="module")
def soak_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # About 16 MB of float32 weights: a leaked copy per cycle would add ~400 MB over the soak.
    return build_causal_lm(
        tmp_path_factory.mktemp("models") / "soak-llama",
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
    )


@pytest.mark.slow
async def test_soak_rss_bounded(start_worker: StartWorker, soak_lm_dir: Path) -> None:
    """Bound: RSS after the last cycle is within 2 weight copies of RSS after the warm-up."""
    worker = await start_worker(soak_lm_dir, "ar", "transformers")
    weights = (await worker.status()).weights_bytes
    assert weights > 12 * MIB
    reference = (await worker.generate(prompt="the cat", max_new_tokens=4)).text.token_ids
    process = psutil.Process()
    bound = 2 * weights
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
        if cycle == 3:
            gc.collect()
            rss_after_warmup = process.memory_info().rss
    gc.collect()
    growth = process.memory_info().rss - rss_after_warmup
    assert growth <= bound, f"RSS grew {growth / MIB:.1f} MiB over {CYCLES - 4} cycles"
