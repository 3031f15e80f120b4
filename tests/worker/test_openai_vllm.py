"""The vLLM stage's gRPC Generate (through the async engine, against the stand-in) answers with
usage and honours the sampling fields on vLLM's terms; what it cannot honour is refused naming
the field."""

from __future__ import annotations

from pathlib import Path

import grpc

from tests.fakegpu.device import FakeGpu
from tests.worker.conftest import StartWorker, rpc_error
from tests.worker.test_vllm_standin import build_model, gpu, start

__all__ = ["gpu"]  # the fixture, used here


async def test_usage_sampling_and_refused_fields(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    worker = await start(start_worker, build_model(tmp_path / "m"))
    answer = await worker.generate(prompt="hello there", max_new_tokens=5)
    assert answer.usage.completion_tokens == len(answer.text.token_ids) == 5
    assert answer.usage.prompt_tokens > 0
    greedy = await worker.generate(prompt="hello there", max_new_tokens=5, temperature=0.0)
    assert list(greedy.text.token_ids) == list(answer.text.token_ids)
    # A sampling temperature and top_p are honoured, seeded per request.
    sampled = [
        await worker.generate(
            prompt="hello there", max_new_tokens=5, temperature=0.7, top_p=0.9, seed=3
        )
        for _ in range(2)
    ]
    assert list(sampled[0].text.token_ids) == list(sampled[1].text.token_ids)
    for field, value in (
        ("stop", ["x"]),  # this model has no tokenizer: stop strings cannot be matched
        ("top_p", 1.5),
        ("top_logprobs", 50),
    ):
        error = await rpc_error(worker.generate(prompt="hello", **{field: value}))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert (error.details() or "").startswith(f"{field}:")
