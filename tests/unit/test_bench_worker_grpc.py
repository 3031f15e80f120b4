"""bench/worker_grpc.py's start of a worker: one that fails while loading (it stays up, FAILED,
and never serves) is reported at once with its log, not waited on for the whole deadline (a
GPU run of bench/multi_gpu.py once hung there until its call's time ran out)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.worker_grpc import INFERENCE, start_worker


def test_a_worker_failing_its_load_is_reported_with_its_log(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama", "hidden_size": "not a size"}')
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="worker failed while starting") as info:
        start_worker(model, "cpu", ["--initial-state=active"], tmp_path / "w.log", INFERENCE)
    assert time.monotonic() - began < 300  # its deadline is 600 s
    assert "failed" in str(info.value).split("ends:", 1)[1]  # the log's end, with its reason
