"""Encode's forward runs on one long-lived thread, whichever request thread asks: CUDA keeps
per-thread device state (cuBLAS handles and workspaces) that a sleep run on another thread
cannot release (on an H200, 8 request threads left 614 MB after a level-1 sleep)."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.causal_lm import CausalLMRunner
from tests.worker.tiny_models import build_causal_lm


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_causal_lm(tmp_path_factory.mktemp("models") / "tiny-encoder")


def test_concurrent_encodes_run_on_one_thread(lm_dir: Path) -> None:
    config = WorkerConfig(
        runner="ar", backend="transformers", model=lm_dir, host="127.0.0.1", port=0, max_batch=8
    )
    runner = CausalLMRunner(config)
    runner.load()
    runner.build_controller().activate()  # the weights, from the files
    ran_on: list[str] = []

    def record(module: Any, args: Any, output: Any) -> None:
        ran_on.append(threading.current_thread().name)

    runner.model.base_model.register_forward_hook(record)
    start = threading.Barrier(8)

    def encode(i: int) -> tuple[str, int]:
        start.wait()
        request = inference_service_pb2.EncodeRequest(request_id=str(i), prompt="the cat sat")
        reply = runner.encode(request)
        return threading.current_thread().name, reply.usage.prompt_tokens

    try:
        with concurrent.futures.ThreadPoolExecutor(8, "request") as pool:
            answers = list(pool.map(encode, range(8)))
    finally:
        runner.close()
    callers = {name for name, _ in answers}
    assert len(callers) == 8 and all(tokens > 0 for _, tokens in answers)
    assert len(ran_on) == 8
    assert len(set(ran_on)) == 1 and not set(ran_on) & callers
