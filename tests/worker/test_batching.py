"""Concurrent AR requests run together (continuous batching) over real gRPC, each with what it
asked for: greedy and seeded outputs equal to the request run alone, its own stops, log
probabilities, usage, finish reason and stream; and the batch's KV cache is gone after a sleep."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Iterable
from pathlib import Path
from typing import Any

import pytest

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for
from tests.worker.tiny_models import SENTENCES, build_causal_lm

STOP = inference_service_pb2.FINISH_REASON_STOP
LENGTH = inference_service_pb2.FINISH_REASON_LENGTH
Response = inference_service_pb2.GenerateResponse


@pytest.fixture(scope="module")
def deep_lm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Many thin layers: a decode step costs far more than what a request adds around it."""
    return build_causal_lm(
        tmp_path_factory.mktemp("models") / "deep-llama",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=24,
    )


@pytest.fixture
async def batching_worker(start_worker: StartWorker, lm_dir: Path) -> WorkerHandle:
    return await start_worker(lm_dir, "ar", "transformers", cpu_threads=1, max_batch=8)


def outputs(response: Response) -> tuple[list[int], str]:
    return list(response.text.token_ids), response.text.text


async def stream(worker: WorkerHandle, **fields: Any) -> tuple[list[Any], Response]:
    """GenerateStream: the chunks and the final response."""
    request = inference_service_pb2.GenerateStreamRequest(
        request=inference_service_pb2.GenerateRequest(**fields)
    )
    chunks: list[Any] = []
    done: Response | None = None
    async for message in worker.inference_stub.GenerateStream(request, metadata=worker.metadata):
        if message.HasField("chunk"):
            chunks.append(message.chunk)
        else:
            done = message.done
    assert done is not None
    return chunks, done


async def batched(calls: Iterable[Awaitable[Response]]) -> list[Response]:
    """Run the calls at once (each a Generate not yet awaited)."""
    return list(await asyncio.gather(*calls))


REQUESTS: list[dict[str, Any]] = [
    {"prompt": SENTENCES[i % len(SENTENCES)], "max_new_tokens": 6 + 3 * i} for i in range(6)
]


async def test_greedy_outputs_equal_unbatched_and_ran_together(
    batching_worker: WorkerHandle,
) -> None:
    w = batching_worker
    alone = [await w.generate(**fields) for fields in REQUESTS]
    assert all(r.batch_size == 1 for r in alone)
    together = await batched(w.generate(**fields) for fields in REQUESTS)
    assert [outputs(r) for r in together] == [outputs(r) for r in alone]
    assert max(r.batch_size for r in together) > 1  # they did run as one batch


@pytest.mark.parametrize("compact", [False, True], ids=["gathered-joins", "compacted-at-once"])
async def test_requests_join_a_running_batch_mid_decode(
    batching_worker: WorkerHandle, monkeypatch: pytest.MonkeyPatch, compact: bool
) -> None:
    """Prompts of other lengths join while a long request decodes (holes in its cache); with
    ``compact`` every join at once and the holes compacted away at every step."""
    from omnistage_worker.runners import decode_policy

    if compact:
        monkeypatch.setattr(decode_policy, "JOIN_EVERY", 1)
        monkeypatch.setattr(decode_policy, "MIN_HOLES", 1)
        monkeypatch.setattr(decode_policy, "HOLE_RATIO", 0.0)
    w = batching_worker
    long_fields: dict[str, Any] = {"prompt": "the sun is bright today", "max_new_tokens": 60}
    short = [{"prompt": s, "max_new_tokens": 5} for s in SENTENCES[:3]]
    reference_long = outputs(await w.generate(**long_fields))
    reference_short = [outputs(await w.generate(**f)) for f in short]

    started = asyncio.Event()
    chunks: list[Any] = []

    async def long_call() -> Response:
        request = inference_service_pb2.GenerateStreamRequest(
            request=inference_service_pb2.GenerateRequest(**long_fields)
        )
        done: Response | None = None
        async for message in w.inference_stub.GenerateStream(request, metadata=w.metadata):
            if message.HasField("chunk"):
                chunks.append(message.chunk)
                started.set()
            else:
                done = message.done
        assert done is not None
        return done

    long_task = asyncio.ensure_future(long_call())
    await asyncio.wait_for(started.wait(), 30)
    joined = await batched(w.generate(**f) for f in short)
    long_response = await long_task
    assert outputs(long_response) == reference_long
    assert [outputs(r) for r in joined] == reference_short
    assert len(reference_long[0]) == long_fields["max_new_tokens"]  # no early end
    assert long_response.batch_size > 1  # the short ones joined it
    batcher = w.server.worker.runner._batcher  # type: ignore[attr-defined]
    assert (batcher.compactions > 0) == compact


async def test_seeded_sampling_is_per_request(batching_worker: WorkerHandle) -> None:
    w = batching_worker
    fields = [
        {"prompt": "the cat sat", "max_new_tokens": 12, "temperature": 1.5, "seed": seed}
        for seed in (1, 2, 3, 4)
    ]
    alone = [outputs(await w.generate(**f)) for f in fields]
    again = await batched(w.generate(**f) for f in reversed(fields))
    assert [outputs(r) for r in reversed(again)] == alone
    assert len({tuple(ids) for ids, _ in alone}) > 1  # the seeds do differ
    # do_sample with temperature unset: the model's default sampling, seeded the same way
    legacy = {"prompt": "a dog ran", "max_new_tokens": 10, "do_sample": True, "seed": 7}
    first = outputs(await w.generate(**legacy))
    mixed = await batched([w.generate(**legacy), w.generate(prompt="we like", max_new_tokens=10)])
    assert outputs(mixed[0]) == first


async def test_usage_finish_reason_and_logprobs(batching_worker: WorkerHandle) -> None:
    w = batching_worker
    tokenizer = w.server.worker.runner.tokenizer  # type: ignore[attr-defined]
    prompt = "the cat sat on the"
    responses = await batched(
        [
            w.generate(prompt=prompt, max_new_tokens=4, top_logprobs=3),
            w.generate(prompt="a bird", max_new_tokens=4, temperature=0.8, seed=5),
        ]
    )
    first, second = responses
    ids = list(first.text.token_ids)
    assert first.usage.prompt_tokens == len(tokenizer(prompt)["input_ids"])
    assert first.usage.completion_tokens == len(ids)
    eos = tokenizer.eos_token_id
    expected = STOP if ids[-1] == eos else LENGTH
    assert first.text.finish_reason == expected
    assert len(ids) == 4 or ids[-1] == eos
    assert [lp.token_id for lp in first.text.logprobs] == ids
    for lp in first.text.logprobs:
        assert len(lp.top) == 3
        assert lp.top[0].token_id == lp.token_id  # greedy: the most likely one
        assert lp.top[0].logprob == pytest.approx(lp.logprob)
        assert lp.top[0].logprob >= lp.top[1].logprob >= lp.top[2].logprob
        assert lp.logprob <= 0
    assert not second.text.logprobs  # only those that ask get them
    assert second.usage.completion_tokens == len(second.text.token_ids)


async def test_stop_sequences_cut_text_and_tokens(batching_worker: WorkerHandle) -> None:
    w = batching_worker
    tokenizer = w.server.worker.runner.tokenizer  # type: ignore[attr-defined]
    base = {"prompt": "we like to", "max_new_tokens": 40}
    full_ids, full_text = outputs(await w.generate(**base))
    words = full_text.split()
    assert len(words) >= 3, full_text
    stop = words[len(words) // 2]
    cut = full_text.index(stop)

    (chunks, streamed), plain = await asyncio.gather(
        stream(w, **base, stop=[stop, "never there"]),
        w.generate(**base, stop=["never there", stop]),
    )
    for response in (streamed, plain):
        assert response.text.text == full_text[:cut]
        assert response.text.finish_reason == STOP
        ids = list(response.text.token_ids)
        assert ids == full_ids[: len(ids)]
        assert stop in tokenizer.decode(ids, skip_special_tokens=True)
        assert stop not in tokenizer.decode(ids[:-1], skip_special_tokens=True)
    # The stream never showed the stop sequence, and its chunks add up to the answer.
    assert "".join(c.text for c in chunks) == streamed.text.text
    assert [t for c in chunks for t in c.token_ids] == list(streamed.text.token_ids)


async def test_streams_are_per_request_under_batching(batching_worker: WorkerHandle) -> None:
    w = batching_worker
    fields = [
        {"prompt": s, "max_new_tokens": 8 + i, "top_logprobs": 1} for i, s in enumerate(SENTENCES)
    ]
    alone = [outputs(await w.generate(**f)) for f in fields]
    results = await asyncio.gather(*(stream(w, **f) for f in fields))
    assert max(done.batch_size for _, done in results) > 1
    for (chunks, done), reference in zip(results, alone, strict=True):
        assert outputs(done) == reference
        assert [t for c in chunks for t in c.token_ids] == reference[0]
        assert "".join(c.text for c in chunks) == reference[1]
        assert all(len(c.token_ids) == 1 for c in chunks)  # one chunk per token, as generated
        assert [lp.token_id for c in chunks for lp in c.logprobs] == reference[0]


async def test_concurrent_requests_are_not_serialised(
    start_worker: StartWorker, deep_lm_dir: Path
) -> None:
    """N concurrent requests finish in well under N times one request's time (a serialising
    worker takes about N times as long; both measured here, on the same worker)."""
    n = 8
    w = await start_worker(deep_lm_dir, "ar", "transformers", cpu_threads=1, max_batch=n)
    fields = {"prompt": "the cat sat on the mat", "max_new_tokens": 24}
    reference = await w.generate(**fields)  # warm
    tokens = len(reference.text.token_ids)
    singles = []
    for _ in range(2):
        began = time.monotonic()
        assert outputs(await w.generate(**fields)) == outputs(reference)
        singles.append(time.monotonic() - began)
    one = min(singles)
    began = time.monotonic()
    together = await batched(w.generate(**fields) for _ in range(n))
    all_of_them = time.monotonic() - began
    assert all(outputs(r) == outputs(reference) for r in together)
    assert max(r.batch_size for r in together) > n // 2
    ratio = all_of_them / (n * one)
    assert ratio < 0.5, f"{n} requests of {tokens} tokens: {all_of_them:.2f}s vs {one:.2f}s each"


async def test_batch_kv_cache_is_counted_and_gone_after_sleep(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    """Tensor accounting on the CPU counts the running batch's KV cache beside the weights:
    the peak shows it, and the sleep ACK measures nothing left once the batch has ended."""
    w = await start_worker(lm_dir, "ar", "transformers", cpu_threads=1, max_batch=8)
    weights = (await w.status()).weights_bytes
    runner = w.server.worker.runner
    seen: list[int] = []

    async def watch() -> None:
        while True:
            seen.append(runner.transient_bytes())
            await asyncio.sleep(0.001)

    watcher = asyncio.ensure_future(watch())
    calls = [w.generate(prompt=s, max_new_tokens=40, temperature=1.0, seed=1) for s in SENTENCES]

    async def sleep_when_running() -> types_pb2.Ack:
        await wait_for(lambda: _true(runner.transient_bytes() > 0), what="a batch to run")
        return await w.sleep(1, task_id="sleep-with-batch")

    sleep_call = asyncio.ensure_future(sleep_when_running())
    answers = await batched(calls)
    ack = await sleep_call
    watcher.cancel()
    assert all(a.text.token_ids for a in answers)  # the drain let the batch finish
    assert max(seen) > 0
    assert ack.ok, ack.error
    assert ack.state == types_pb2.WORKER_STATE_ASLEEP
    assert ack.peak_active_bytes > weights  # the batch's KV cache was measured while active
    assert ack.used_after_bytes == 0  # weights and KV cache both gone
    assert runner.transient_bytes() == 0


async def _true(value: bool) -> bool:
    return value


def test_a_failing_stream_does_not_fail_the_batch(lm_dir: Path) -> None:
    """A receiver that raises (its event loop closed) loses its stream, not its answer, and
    the other requests of the batch go on."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omnistage_worker.runners.decode_batch import DecodeBatcher, Job
    from omnistage_worker.runners.sampling import Sampling

    model: Any = AutoModelForCausalLM.from_pretrained(lm_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    batcher = DecodeBatcher(
        model, tokenizer=tokenizer, device=torch.device("cpu"), max_batch=4, eos_ids=set(), pad_id=3
    )
    calls: list[int] = []

    def broken(chunk: inference_service_pb2.TextChunk) -> None:
        calls.append(len(chunk.token_ids))
        raise RuntimeError("Event loop is closed")

    ids = [int(t) for t in tokenizer("the cat sat")["input_ids"]]
    jobs = [
        Job(inference_service_pb2.GenerateRequest(), ids, 6, Sampling(greedy=True), sink)
        for sink in (broken, None)
    ]
    try:
        answers = [batcher.submit(job).result(timeout=60) for job in jobs]
    finally:
        batcher.close()
    assert calls == [1]  # called once, then dropped
    assert [len(a.text.token_ids) for a in answers] == [6, 6]
    assert answers[0].text.token_ids == answers[1].text.token_ids
