"""The official ``openai`` client (pinned in the dev extra) against every stage kind over real HTTP.

Stages: the tiny torch AR stage, the tiny diffusion stage, and the group router in front of
them (``TEXT_TARGETS``). The vLLM stage joins through the :func:`vllm_stage` fixture: once it
serves its OpenAI API (the vllmserve work), make that hook return its base URL and add
``"vllm"`` to ``TEXT_TARGETS``; every text test then runs against it too.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from omnistage_worker.serving.router import Router
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for

MODEL = "tiny-lm"
IMAGES = "tiny-sd"
TOKEN = "conformance-token"
TEXT_TARGETS = ["torch", "router"]


VllmStage = Callable[[], Awaitable[str | None]]


@pytest.fixture
def vllm_stage(start_worker: StartWorker) -> VllmStage:
    """HOOK for the vLLM stage: starts it, returns its OpenAI base URL (``http://host:port/v1``)
    serving ``MODEL``; called only by the "vllm" target.

    None until the vLLM stage serves through vLLM's own OpenAI server (tests/fakevllm stands
    in for vLLM on CPU: take the ``gpu`` fixture of tests/worker/test_vllm_standin.py here);
    then add "vllm" to ``TEXT_TARGETS``.
    """

    async def start() -> str | None:
        return None

    return start


@contextlib.asynccontextmanager
async def serve(app: Any) -> AsyncIterator[str]:
    """Serve an ASGI app on a free port; its base URL."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn has no "started" event to await
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        await task


def base(worker: WorkerHandle) -> str:
    return f"http://127.0.0.1:{worker.server.http_port}"


def client(url: str, key: str = "unused", retries: int = 0) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=retries, timeout=60)


@dataclass
class Stages:
    lm: WorkerHandle
    sd: WorkerHandle
    router: str


@pytest.fixture
async def stages(
    start_worker: StartWorker, lm_dir: Path, diffusion_dir: Path
) -> AsyncIterator[Stages]:
    lm = await start_worker(lm_dir, "ar", "transformers", http_port=0, served_model_name=MODEL)
    sd = await start_worker(
        diffusion_dir, "diffusion", "diffusers", http_port=0, served_model_name=IMAGES
    )
    async with serve(Router({MODEL: [base(lm)], IMAGES: [base(sd)]}).asgi) as router:
        yield Stages(lm, sd, router)


@pytest.fixture(params=TEXT_TARGETS)
async def text(
    request: pytest.FixtureRequest, stages: Stages, vllm_stage: VllmStage
) -> openai.AsyncOpenAI:
    if request.param == "router":
        return client(stages.router)
    if request.param == "vllm":
        url = await vllm_stage()
        assert url is not None, "the vllm_stage hook is not wired"
        return openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    return client(base(stages.lm))


async def test_completion_and_chat_carry_usage_and_finish_reason(text: openai.AsyncOpenAI) -> None:
    done = await text.completions.create(model=MODEL, prompt="the cat sat", max_tokens=5)
    assert done.choices[0].finish_reason == "length"
    assert done.usage is not None
    assert done.usage.prompt_tokens == 3 and done.usage.completion_tokens == 5
    assert done.usage.total_tokens == 8
    chat = await text.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "the cat"}], max_completion_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length"
    assert chat.usage is not None and chat.usage.completion_tokens == 4
    assert chat.usage.prompt_tokens > 2  # the rendered chat, not the content alone


async def test_streaming_with_usage(text: openai.AsyncOpenAI) -> None:
    whole = await text.completions.create(model=MODEL, prompt="the cat sat", max_tokens=6)
    stream = await text.completions.create(
        model=MODEL,
        prompt="the cat sat",
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (3, 6)
    assert all(c.usage is None for c in chunks[:-1])
    chat = await text.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = [chunk async for chunk in chat]
    assert pieces[0].choices[0].delta.role == "assistant"
    assert pieces[-1].usage is not None and pieces[-1].usage.completion_tokens == 3
    # without include_usage: no usage chunk
    plain = await text.completions.create(model=MODEL, prompt="the cat", max_tokens=2, stream=True)
    assert all(c.choices for c in [c async for c in plain])


async def test_stop_cuts_the_text_and_ends_generation(text: openai.AsyncOpenAI) -> None:
    free = await text.completions.create(model=MODEL, prompt="the cat sat", max_tokens=8)
    words = free.choices[0].text.split()
    stop = words[2]
    assert stop not in words[:2]  # the first occurrence is the third word
    cut = await text.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=8, stop=[stop, "zzz-never"]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].text.split()
    assert cut.choices[0].text.split() == words[:2]
    assert cut.usage is not None and cut.usage.completion_tokens == 3  # up to the stop token
    streamed = await text.completions.create(
        model=MODEL, prompt="the cat sat", max_tokens=8, stop=stop, stream=True
    )
    pieces = [c async for c in streamed]
    assert "".join(c.choices[0].text for c in pieces) == cut.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "stop"


async def test_seed_determinism_and_n(text: openai.AsyncOpenAI) -> None:
    def ask(seed: int, n: int = 1) -> Awaitable[Any]:
        return text.completions.create(
            model=MODEL, prompt="the cat", max_tokens=12, temperature=1.0, seed=seed, n=n
        )

    a, b, other = await ask(7), await ask(7), await ask(8)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != other.choices[0].text
    three = await ask(7, n=3)
    ninth = await ask(9)
    assert [c.index for c in three.choices] == [0, 1, 2]
    # choice i is the generation with seed + i
    assert [c.text for c in three.choices] == [
        a.choices[0].text,
        other.choices[0].text,
        ninth.choices[0].text,
    ]
    assert three.usage is not None and a.usage and other.usage and ninth.usage
    singles = [a.usage, other.usage, ninth.usage]
    assert three.usage.prompt_tokens == 2  # the prompt counts once
    assert three.usage.completion_tokens == sum(u.completion_tokens for u in singles)
    streamed = await text.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=4,
        n=2,
        temperature=1.0,
        seed=3,
        stream=True,
    )
    by_index: dict[int, str] = {}
    finished = set()
    async for chunk in streamed:
        for choice in chunk.choices:
            by_index[choice.index] = by_index.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1} and set(by_index) == {0, 1}


async def test_logprobs(text: openai.AsyncOpenAI) -> None:
    done = await text.completions.create(model=MODEL, prompt="the cat", max_tokens=4, logprobs=3)
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    assert len(logprobs.tokens) == 4 and logprobs.token_logprobs is not None
    assert logprobs.top_logprobs is not None
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert value <= 0
        assert max(top.values()) >= value  # greedy: the chosen token is the most likely
        assert top.get(token) == pytest.approx(value)
    chat = await text.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in content.content)
    plain = await text.completions.create(model=MODEL, prompt="the cat", max_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_streamed_logprobs_come_with_their_tokens(text: openai.AsyncOpenAI) -> None:
    """Each streamed chunk with text carries its tokens' log probabilities (not all in the
    last chunk); together they equal the unstreamed answer's, offsets included."""
    whole = await text.completions.create(model=MODEL, prompt="the cat", max_tokens=6, logprobs=2)
    expected = whole.choices[0].logprobs
    assert expected is not None and expected.tokens is not None
    streamed = await text.completions.create(
        model=MODEL, prompt="the cat", max_tokens=6, logprobs=2, stream=True
    )
    tokens: list[str] = []
    values: list[float] = []
    offsets: list[int] = []
    carrying = 0
    async for chunk in streamed:
        choice = chunk.choices[0]
        if choice.text:
            assert choice.logprobs is not None and choice.logprobs.tokens  # its own tokens
        if choice.logprobs is not None and choice.logprobs.tokens:
            carrying += 1
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs or []
            offsets += choice.logprobs.text_offset or []
    assert carrying > 1
    assert tokens == expected.tokens
    assert values == pytest.approx(expected.token_logprobs)
    assert offsets == expected.text_offset
    chat = await text.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=1,
        stream=True,
    )
    entries = []
    async for part in chat:
        if part.choices and part.choices[0].logprobs and part.choices[0].logprobs.content:
            entries.append(len(part.choices[0].logprobs.content))
    assert len(entries) > 1 and sum(entries) == 4


@pytest.mark.parametrize("target", ["torch", "router"])
async def test_images(stages: Stages, target: str) -> None:
    api = client(stages.router if target == "router" else base(stages.sd))
    done = await api.images.generate(
        model=IMAGES,
        prompt="a red square",
        size="64x64",
        n=2,
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 5},
    )
    assert done.data is not None and len(done.data) == 2
    pngs = [base64.b64decode(d.b64_json or "") for d in done.data]
    assert all(p.startswith(b"\x89PNG") for p in pngs)
    assert pngs[0] != pngs[1]  # seeds 5 and 6
    usage = done.usage
    assert usage is not None and usage.input_tokens > 0  # the prompt, once for both images
    assert usage.input_tokens_details.text_tokens == usage.input_tokens
    assert usage.output_tokens == 0 and usage.total_tokens == usage.input_tokens
    assert (usage.model_extra or {}) == {"images": 2, "steps": 2}
    longer = await api.images.generate(
        model=IMAGES, prompt="a red square on a blue square", size="64x64", n=1,
        extra_body={"num_inference_steps": 1},
    )  # fmt: skip
    assert longer.usage is not None and longer.usage.input_tokens > usage.input_tokens
    assert (longer.usage.model_extra or {}) == {"images": 1, "steps": 1}
    with pytest.raises(openai.BadRequestError) as info:
        await api.images.generate(model=IMAGES, prompt="x", size="65x64")
    assert info.value.body["param"] == "size"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        await api.images.generate(model=IMAGES, prompt="x", response_format="url")
    assert info.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as info:
        await api.images.generate(model=IMAGES, prompt="x", quality="hd")
    assert info.value.body["param"] == "quality"  # type: ignore[index]


Refusal = Callable[[openai.AsyncOpenAI], Awaitable[Any]]
REFUSED: list[tuple[str, Refusal]] = [
    (
        "tools",
        lambda c: c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        ),
    ),
    (
        "response_format",
        lambda c: c.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_object"},
        ),
    ),
    (
        "logit_bias",
        lambda c: c.completions.create(model=MODEL, prompt="x", logit_bias={"1": 5}),
    ),
    (
        "presence_penalty",
        lambda c: c.completions.create(model=MODEL, prompt="x", presence_penalty=0.5),
    ),
    ("echo", lambda c: c.completions.create(model=MODEL, prompt="x", echo=True)),
    ("suffix", lambda c: c.completions.create(model=MODEL, prompt="x", suffix="y")),
    ("best_of", lambda c: c.completions.create(model=MODEL, prompt="x", best_of=3)),
    (
        "modalities",
        lambda c: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], modalities=["audio"]
        ),
    ),
    (
        "frobnicate",
        lambda c: c.completions.create(model=MODEL, prompt="x", extra_body={"frobnicate": 1}),
    ),
    (
        "stop",
        lambda c: c.completions.create(model=MODEL, prompt="x", stop=["a", "b", "c", "d", "e"]),
    ),
    ("max_tokens", lambda c: c.completions.create(model=MODEL, prompt="the cat", max_tokens=127)),
    (
        "max_completion_tokens",
        lambda c: c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_completion_tokens=500
        ),
    ),
    ("top_p", lambda c: c.completions.create(model=MODEL, prompt="x", top_p=1.5)),
    ("logprobs", lambda c: c.completions.create(model=MODEL, prompt="x", logprobs=21)),
]


@pytest.mark.parametrize(("param", "call"), REFUSED, ids=[p for p, _ in REFUSED])
async def test_a_field_the_stage_cannot_honour_is_refused_naming_it(
    text: openai.AsyncOpenAI, param: str, call: Refusal
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        await call(text)
    assert info.value.body["param"] == param  # type: ignore[index]
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_unknown_model_is_not_found(text: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await text.completions.create(model="nope", prompt="x")
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]


async def test_status_errors_map_to_the_clients_classes(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    manual = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, served_model_name=MODEL, initial_state="asleep"
    )
    with pytest.raises(openai.ConflictError):  # 409: a Manual stage that is asleep
        await client(base(manual)).completions.create(model=MODEL, prompt="x")
    lazy = await start_worker(
        lm_dir,
        "ar",
        "transformers",
        http_port=0,
        served_model_name=MODEL,
        activation="ondemand",
        initial_state="asleep",
        max_held=1,
        hold_timeout_s=3.0,
    )
    api = client(base(lazy))
    held = asyncio.ensure_future(api.completions.create(model=MODEL, prompt="x", max_tokens=1))

    async def one_held() -> bool:
        return lazy.server.worker.demand.held == 1

    await wait_for(one_held, what="a held request")
    with pytest.raises(openai.RateLimitError) as full:  # 429: the hold queue is full
        await api.completions.create(model=MODEL, prompt="x")
    assert full.value.response.headers["retry-after"] == "1"
    with pytest.raises(openai.APIStatusError) as timeout:  # 503 past the hold timeout
        await held
    assert timeout.value.status_code == 503
    assert timeout.value.body["code"] == "hold_timeout"  # type: ignore[index]
    with pytest.raises(openai.APIStatusError) as large:  # 413: a body over the limit
        await api.completions.create(model=MODEL, prompt="x " * 600_000)
    assert large.value.status_code == 413


async def test_bearer_token_on_the_stage_and_the_router(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    lm = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, served_model_name=MODEL, http_token=TOKEN
    )
    router = Router({MODEL: [base(lm)]}, token=TOKEN)
    async with serve(router.asgi) as routed:
        for url in (base(lm), routed):
            with pytest.raises(openai.AuthenticationError):
                await client(url).completions.create(model=MODEL, prompt="x", max_tokens=1)
            with pytest.raises(openai.AuthenticationError):
                await client(url).models.list()
            done = await client(url, TOKEN).completions.create(
                model=MODEL, prompt="the cat", max_tokens=1
            )
            assert done.usage is not None and done.usage.completion_tokens == 1
            async with httpx.AsyncClient() as http:
                assert (await http.get(f"{url}/health")).status_code == 200
