"""A vLLM stage serves through vLLM's own OpenAI app over its async engine (issue 18).

The worker runs in this process with ``tests/fakevllm`` on ``sys.path`` (``import vllm`` is
the stand-in): its ``AsyncLLM`` engine core is a child process that batches (a scheduler step
of ``STEP_S`` runs every admitted request, whatever their number) and holds memory on the
simulated GPU. Requests go over real HTTP with the official ``openai`` client. What is checked:
concurrent requests are batched (serialised, they would take N times as long), every answer
carries usage, a sleeping stage holds requests at the worker's front (none reaches the engine
while it sleeps), a sleep drains the requests in flight (the engine would abort them), a
Manual stage that is not Active answers 409, vLLM's own sleep routes are refused, and nothing
is lost across 100 sleep/wake cycles under load.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from omnistage.worker.v1 import types_pb2
from omnistage_worker.config import DeviceSpec, VllmArgs
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device
from tests.fakevllm.models import STANDIN_PATH, build_standin_model
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for

TOTAL = 40_000_000
CONTEXT = 100_000
WEIGHTS = 400_000
BUDGET = 8_000_000
STEP_S = 0.05  # the stand-in's scheduler step: dominates a request's time

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture
def gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeGpu]:
    device = Device(uuid="GPU-s", total=TOTAL, reserve=0, context=CONTEXT, activation=0.1)
    fake = FakeGpu.create(tmp_path / "gpu", device)
    monkeypatch.setenv("OMNISTAGE_MEMORY_PROBE", "tests.fakegpu.probe:from_env")
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", str(fake.dir))
    monkeypatch.setenv("OMNISTAGE_STANDIN_STEP_S", str(STEP_S))
    monkeypatch.syspath_prepend(str(STANDIN_PATH))
    yield fake


async def start(
    start_worker: StartWorker, tmp_path: Path, activation: str = "manual", **engine: Any
) -> WorkerHandle:
    model_dir = build_standin_model(tmp_path / "m", WEIGHTS)
    return await start_worker(
        model_dir, "ar", "vllm", device=DeviceSpec("cuda"), http_port=0,
        activation=activation, served_model_name="llm",
        vllm=VllmArgs(memory_bytes=BUDGET, enforce_eager=True, **engine),
    )  # fmt: skip


def client(w: WorkerHandle, retries: int = 0) -> openai.AsyncOpenAI:
    base = f"http://127.0.0.1:{w.server.http_port}/v1"
    return openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=retries, timeout=120)


async def complete(c: openai.AsyncOpenAI, tokens: int, prompt: str = "the cat sat") -> Any:
    return await c.completions.create(model="llm", prompt=prompt, max_tokens=tokens, temperature=0)


async def test_concurrent_requests_are_batched_and_carry_usage(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, tmp_path)
    c = client(w)
    tokens, n = 10, 8
    began = time.monotonic()
    one = await complete(c, tokens)
    alone = time.monotonic() - began
    assert one.usage is not None
    assert (one.usage.prompt_tokens, one.usage.completion_tokens) == (11, tokens)
    assert one.choices[0].finish_reason == "length"

    began = time.monotonic()
    answers = await asyncio.gather(*(complete(c, tokens, f"prompt {i}") for i in range(n)))
    together = time.monotonic() - began
    # Served one after the other they would take n times as long; batched, about one's time.
    assert together < 0.4 * n * alone, (together, alone)
    for a in answers:
        assert a.usage is not None and a.usage.completion_tokens == tokens
    # The same prompt gives the same text alone or in a batch (greedy).
    again = await asyncio.gather(*(complete(c, tokens) for _ in range(3)))
    assert {a.choices[0].text for a in again} == {one.choices[0].text}

    # gRPC Generate goes through the same engine and batches too.
    began = time.monotonic()
    grpc_answers = await asyncio.gather(
        *(w.generate(prompt=f"p{i}", max_new_tokens=tokens) for i in range(n))
    )
    assert time.monotonic() - began < 0.4 * n * alone
    assert max(r.batch_size for r in grpc_answers) > 1
    assert all(r.usage.completion_tokens == tokens for r in grpc_answers)


async def test_streaming_usage_n_and_stop_are_vllms(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, tmp_path)
    c = client(w)
    stream = await c.chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = [chunk async for chunk in stream]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    many = await c.completions.create(
        model="llm", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=7
    )
    assert len(many.choices) == 3 and many.usage is not None
    assert many.usage.completion_tokens == 15
    same = await c.completions.create(
        model="llm", prompt="abc", max_tokens=5, n=3, temperature=1.0, seed=7
    )
    assert [x.text for x in same.choices] == [x.text for x in many.choices]
    full = (await complete(c, 12)).choices[0].text
    stop = full[3:5]
    cut = await c.completions.create(
        model="llm", prompt="the cat sat", max_tokens=12, stop=[stop], temperature=0
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[: full.index(stop)]
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await complete(c, 5000)


async def test_asleep_stage_holds_requests_at_the_front_until_woken(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, tmp_path, activation="ondemand")
    c = client(w)
    reference = (await complete(c, 4)).choices[0].text
    assert (await w.sleep(1)).ok
    held = [asyncio.ensure_future(complete(c, 4)) for _ in range(3)]
    await wait_for(lambda: _held(w, 3), within=10, what="three requests held")
    await asyncio.sleep(0.3)
    assert not any(h.done() for h in held)
    engine = engine_of(w)
    assert (await engine._call("state"))["added_while_asleep"] == 0  # none reached the engine
    assert (await w.wake()).ok
    answers = await asyncio.gather(*held)
    assert [a.choices[0].text for a in answers] == [reference] * 3
    assert (await engine._call("state"))["added_while_asleep"] == 0


async def test_a_field_vllm_would_ignore_is_refused_naming_it_before_any_hold(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    """vLLM's request models take any extra field and serve without it; the stage refuses a
    field its vLLM does not define (400 naming it), also while asleep (nothing held, no wake
    asked), and passes vLLM's own extensions."""
    w = await start(start_worker, tmp_path, activation="ondemand")
    c = client(w)
    chat: Any = [{"role": "user", "content": "hi"}]
    asks: list[tuple[str, Any]] = [
        ("best_of", c.completions.create(model="llm", prompt="x", max_tokens=2, best_of=3)),
        ("frobnicate", c.completions.create(
            model="llm", prompt="x", max_tokens=2, extra_body={"frobnicate": 1})),
        ("modalities", c.chat.completions.create(
            model="llm", messages=chat, max_tokens=2, modalities=["audio"])),
        ("functions", c.chat.completions.create(
            model="llm", messages=chat, max_tokens=2,
            functions=[{"name": "f", "parameters": {}}])),
    ]  # fmt: skip
    for field, ask in asks:
        with pytest.raises(openai.BadRequestError) as info:
            await ask
        body: Any = info.value.body
        assert (body["param"], body["type"]) == (field, "invalid_request_error"), body
    # vLLM's own extensions are fields of its models: served.
    own = await c.completions.create(
        model="llm", prompt="x", max_tokens=2, extra_body={"top_k": 5, "ignore_eos": True}
    )
    assert own.usage is not None and own.usage.completion_tokens == 2
    assert (await w.sleep(1)).ok
    before = w.server.worker.demand.figures()
    with pytest.raises(openai.BadRequestError):
        await c.completions.create(model="llm", prompt="x", max_tokens=2, best_of=3)
    after = w.server.worker.demand.figures()  # never held: no wake asked for
    assert (after.held, after.held_total) == (0, before.held_total)


async def test_tool_reasoning_and_chat_template_options_reach_vllms_app(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    """spec.vllm's chat options, as the worker's flags, reach vLLM's app state; the chat
    template file is what renders a chat (the prompt the engine counts is the template's)."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[turn] {{ m.content }} {% endfor %}[answer]")
    w = await start(
        start_worker, tmp_path, enable_auto_tool_choice=True, tool_call_parser="hermes",
        reasoning_parser="deepseek_r1", chat_template=template,
    )  # fmt: skip
    runner: Any = w.server.worker.runner
    state = runner.app.state
    assert (state.enable_auto_tools, state.tool_parser) == (True, "hermes")
    assert state.reasoning_parser == "deepseek_r1"
    assert state.chat_template == template.read_text()
    answer = await client(w).chat.completions.create(
        model="llm", messages=[{"role": "user", "content": "hi"}], max_tokens=3
    )
    assert answer.usage is not None
    assert answer.usage.prompt_tokens == len(engine_of(w).encode("[turn] hi [answer]"))


def engine_of(w: WorkerHandle) -> Any:
    """The stand-in AsyncLLM of a worker (for its test-only ``state`` call)."""
    runner: Any = w.server.worker.runner
    return runner.engine


async def _held(w: WorkerHandle, n: int) -> bool:
    return w.server.worker.demand.held >= n


async def test_manual_stage_not_active_answers_409_and_vllm_sleep_routes_are_refused(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, tmp_path)
    c = client(w)
    assert (await w.sleep(1)).ok
    with pytest.raises(openai.ConflictError):
        await complete(c, 4)
    models = await c.models.list()  # read-only routes are served asleep too
    assert [m.id for m in models.data] == ["llm"]
    assert (await w.wake()).ok
    for path in ("/sleep", "/wake_up"):
        response = await c._client.post(f"http://127.0.0.1:{w.server.http_port}{path}")
        assert response.status_code == 403
    assert (await w.status()).state == types_pb2.WORKER_STATE_ACTIVE
    assert (await complete(c, 4)).usage is not None


async def test_sleep_drains_the_running_batch_instead_of_aborting_it(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, tmp_path)
    c = client(w)
    tokens = 30  # 1.5 s at STEP_S
    running = [asyncio.ensure_future(complete(c, tokens, f"p{i}")) for i in range(4)]
    await wait_for(lambda: _inflight(w, 4), within=10, what="four requests in flight")
    ack = await w.sleep(1)
    assert ack.ok, ack.error
    assert ack.drain_duration.ToTimedelta().total_seconds() > 0.5  # it waited for the batch
    for answer in await asyncio.gather(*running):
        assert answer.choices[0].finish_reason == "length"  # finished, not aborted
        assert answer.usage is not None and answer.usage.completion_tokens == tokens
    assert gpu.snapshot().used_total < WEIGHTS  # and then the engine slept


async def _inflight(w: WorkerHandle, n: int) -> bool:
    return int((await w.status()).inflight_requests) >= n


async def test_nothing_is_lost_across_100_sleep_wake_cycles_under_load(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OMNISTAGE_STANDIN_STEP_S", "0.002")
    w = await start(start_worker, tmp_path, activation="ondemand")
    c = client(w)
    reference = (await complete(c, 3)).choices[0].text
    stop = asyncio.Event()
    answers: list[str] = []
    failures: list[BaseException] = []

    async def load() -> None:
        while not stop.is_set():
            try:
                answer = await complete(c, 3)
            except Exception as exc:
                failures.append(exc)
            else:
                answers.append(answer.choices[0].text)

    clients = [asyncio.ensure_future(load()) for _ in range(6)]
    try:
        for cycle in range(100):
            ack = await w.sleep(1 + cycle % 2 if cycle % 10 == 9 else 1)
            assert ack.ok, f"cycle {cycle}: {ack.error}"
            wake = await w.wake()
            assert wake.ok, f"cycle {cycle}: {wake.error}"
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await asyncio.gather(*clients)
    assert not failures, failures[:3]
    assert len(answers) > 100
    assert set(answers) == {reference}
    engine = engine_of(w)
    assert (await engine._call("state"))["added_while_asleep"] == 0


async def test_a_client_that_disconnects_while_held_leaves_the_queue(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    import httpx

    w = await start(start_worker, tmp_path, activation="ondemand")
    assert (await w.sleep(1)).ok
    url = f"http://127.0.0.1:{w.server.http_port}/v1/completions"
    body = {"model": "llm", "prompt": "hi", "max_tokens": 4}
    async with httpx.AsyncClient() as http:
        request = asyncio.ensure_future(http.post(url, json=body, timeout=60))
        await wait_for(lambda: _held(w, 1), within=10, what="the request held")
        request.cancel()  # the client goes away (its connection closes)
        with contextlib.suppress(asyncio.CancelledError):
            await request
    await wait_for(lambda: _held_none(w), within=10, what="the hold queue empty again")
    assert w.server.worker.inflight == 0
    assert (await w.wake()).ok


async def _held_none(w: WorkerHandle) -> bool:
    return w.server.worker.demand.held == 0


async def test_footprint_is_the_engines_weights_and_kv_pool_as_measured(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    w = await start(start_worker, tmp_path)
    (engine,) = gpu.live().values()
    assert engine.weights > 0
    held = engine.used  # context + weights + the KV pool the engine took at start
    assert engine.pool > engine.weights  # the KV pool is most of the budget
    st = await w.status()
    assert st.active_footprint_bytes == held and st.used_bytes == held
    c = client(w)
    await asyncio.gather(*(complete(c, 5, f"p{i}") for i in range(8)))
    st = await w.status()
    assert st.peak_active_bytes == held  # batching takes nothing beyond the engine's pool


async def test_a_going_worker_answers_what_it_held_as_unserved(
    start_worker: StartWorker, gpu: FakeGpu, tmp_path: Path
) -> None:
    """At shutdown the held requests get 503 + Retry-After + ``x-omnistage-unserved`` (they
    never reached the engine), so a router sends them to the stage's next pod."""
    import httpx

    from omnistage_worker.control.queued import UNSERVED_HEADER

    w = await start(start_worker, tmp_path, activation="ondemand")
    assert (await w.sleep(1)).ok
    url = f"http://127.0.0.1:{w.server.http_port}/v1/completions"
    body = {"model": "llm", "prompt": "hi", "max_tokens": 4}
    async with httpx.AsyncClient() as http:
        request = asyncio.ensure_future(http.post(url, json=body, timeout=60))
        await wait_for(lambda: _held(w, 1), within=10, what="the request held")
        stopping = asyncio.ensure_future(w.server.stop(30.0))
        answer = await request
        await asyncio.wait_for(stopping, 30)
    assert answer.status_code == 503, answer.text
    assert answer.headers["retry-after"] == "1"
    assert answer.headers[UNSERVED_HEADER] == "shutting-down"
