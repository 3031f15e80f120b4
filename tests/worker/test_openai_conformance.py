"""The official ``openai`` client (pinned in the dev extra) against every stage kind over real HTTP.

Stages: the tiny torch AR stage, the tiny diffusion stage, the group router in front of them,
and a running vLLM stage (``TEXT_TARGETS``). The vLLM stage needs a GPU and vLLM, which CI
lacks, so its target is collected only when ``OMNISTAGE_CONFORMANCE_VLLM`` gives the stage's
HTTP root (``http://host:port``) and ``OMNISTAGE_CONFORMANCE_VLLM_MODEL`` its served model
name: ``bench/vllm_conformance.py`` starts one on a GPU host and runs ``-k vllm`` against it.
Without the variable no vLLM test exists (nothing is skipped, nothing passes in its name).

The text tests hold for any correct OpenAI server whatever its tokenizer: token counts are
read from ``usage`` and checked against each other, stop strings are picked from the model's
own output, determinism is two answers compared, a greedy answer is asked for with
``temperature=0``, and a generation may end on the model's end-of-sequence token
(``finish_reason == "stop"``, fewer tokens) where a tiny model never does. Only this project's
own stages (``Text.own``) are held to their documented refusals and error codes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
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
#: a running vLLM stage's HTTP root and served model name (bench/vllm_conformance.py)
VLLM_URL = "OMNISTAGE_CONFORMANCE_VLLM"
VLLM_MODEL = "OMNISTAGE_CONFORMANCE_VLLM_MODEL"
TEXT_TARGETS = ["torch", "router", *(["vllm"] if os.environ.get(VLLM_URL) else [])]


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


_OPEN: list[openai.AsyncOpenAI] = []


def client(url: str, key: str = "unused", retries: int = 0) -> openai.AsyncOpenAI:
    """A client of ``url``, closed when its test ends (on the test's own event loop)."""
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=retries, timeout=60)
    _OPEN.append(api)
    return api


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await _OPEN.pop().close()


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


@dataclass
class Text:
    """One text target: its client, the model name it serves, and whether it is one of this
    project's own stages (the torch stage or the router), held to their documented refusals."""

    api: openai.AsyncOpenAI
    model: str
    own: bool


@pytest.fixture(params=TEXT_TARGETS)
def text(request: pytest.FixtureRequest) -> Text:
    """The target's client; the torch stage and the router start only for their own params."""
    if request.param == "vllm":
        model = os.environ.get(VLLM_MODEL)
        assert model, f"{VLLM_URL} is set but {VLLM_MODEL} (its served model name) is not"
        return Text(client(os.environ[VLLM_URL]), model, own=False)
    stages: Stages = request.getfixturevalue("stages")
    url = stages.router if request.param == "router" else base(stages.lm)
    return Text(client(url), MODEL, own=True)


def ended(finish: str | None, tokens: int, max_tokens: int) -> bool:
    """A generation's token count agrees with how it ended: cut at ``max_tokens`` ("length"),
    or ended early by the end-of-sequence token or a stop string ("stop")."""
    if finish == "length":
        return tokens == max_tokens
    return finish == "stop" and 1 <= tokens <= max_tokens


def stop_char(text: str) -> int | None:
    """Where the first character of ``text`` (not its first) that occurs there for the first
    time, is printable and not a replacement character lies: a stop string the model will
    produce again at the same place."""
    for at in range(1, len(text)):
        char = text[at]
        if char not in text[:at] and char.isprintable() and char.strip() and char != "\ufffd":
            return at
    return None


async def test_completion_and_chat_carry_usage_and_finish_reason(text: Text) -> None:
    api, model = text.api, text.model
    done = await api.completions.create(model=model, prompt="the cat sat", max_tokens=5)
    usage = done.usage
    assert usage is not None and usage.prompt_tokens > 0
    assert ended(done.choices[0].finish_reason, usage.completion_tokens, 5)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    again = await api.completions.create(model=model, prompt="the cat sat", max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens == usage.prompt_tokens
    longer = await api.completions.create(model=model, prompt="the cat sat on", max_tokens=1)
    assert longer.usage is not None and longer.usage.prompt_tokens > usage.prompt_tokens
    chat = await api.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "the cat"}], max_completion_tokens=4
    )
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage is not None
    assert ended(chat.choices[0].finish_reason, chat.usage.completion_tokens, 4)
    bare = await api.completions.create(model=model, prompt="the cat", max_tokens=1)
    assert bare.usage is not None  # the rendered chat, not the content alone
    assert chat.usage.prompt_tokens > bare.usage.prompt_tokens


async def test_streaming_with_usage(text: Text) -> None:
    api, model = text.api, text.model
    whole = await api.completions.create(
        model=model, prompt="the cat sat", max_tokens=6, temperature=0
    )
    stream = await api.completions.create(
        model=model,
        prompt="the cat sat",
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None and whole.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (
        whole.usage.prompt_tokens,
        whole.usage.completion_tokens,
    )
    assert ended(whole.choices[0].finish_reason, whole.usage.completion_tokens, 6)
    assert all(c.usage is None for c in chunks[:-1])
    chat = await api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = [chunk async for chunk in chat]
    assert pieces[0].choices[0].delta.role == "assistant"
    finish = [
        c.choices[0].finish_reason for c in pieces if c.choices and c.choices[0].finish_reason
    ]
    assert pieces[-1].usage is not None and len(finish) == 1
    assert ended(finish[0], pieces[-1].usage.completion_tokens, 3)
    # without include_usage: no usage chunk
    plain = await api.completions.create(model=model, prompt="the cat", max_tokens=2, stream=True)
    assert all(c.choices for c in [c async for c in plain])


async def test_stop_cuts_the_text_and_ends_generation(text: Text) -> None:
    """The stop string is a character of the model's own seeded answer, at its first place:
    the same seed cuts the answer just before it."""
    api, model = text.api, text.model
    for seed in range(1, 9):  # a seed whose answer has a usable character
        free = await api.completions.create(
            model=model, prompt="the cat sat", max_tokens=16, temperature=1.0, seed=seed
        )
        at = stop_char(free.choices[0].text)
        if at is not None:
            break
    assert at is not None, f"no stop character in {free.choices[0].text!r}"
    whole, stop = free.choices[0].text, free.choices[0].text[at]
    cut = await api.completions.create(
        model=model,
        prompt="the cat sat",
        max_tokens=16,
        temperature=1.0,
        seed=seed,
        stop=[stop, "zzz-never"],
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == whole[:at]
    assert cut.usage is not None and free.usage is not None
    assert 1 <= cut.usage.completion_tokens <= free.usage.completion_tokens  # up to the stop
    streamed = await api.completions.create(
        model=model,
        prompt="the cat sat",
        max_tokens=16,
        temperature=1.0,
        seed=seed,
        stop=stop,
        stream=True,
    )
    pieces = [c async for c in streamed]
    assert "".join(c.choices[0].text for c in pieces) == cut.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "stop"


async def test_seed_determinism_and_n(text: Text) -> None:
    """The same seed gives the same answer, another seed another; with ``n``, choice i is the
    answer of seed + i (the torch stage's rule, and vLLM's: its parallel sampling seeds each
    child so)."""
    api, model = text.api, text.model

    def ask(seed: int, n: int = 1) -> Awaitable[Any]:
        return api.completions.create(
            model=model, prompt="the cat", max_tokens=12, temperature=1.0, seed=seed, n=n
        )

    a, b, other = await ask(7), await ask(7), await ask(8)
    assert a.choices[0].text == b.choices[0].text
    assert a.choices[0].text != other.choices[0].text
    three = await ask(7, n=3)
    ninth = await ask(9)
    assert [c.index for c in three.choices] == [0, 1, 2]
    texts = [c.text for c in three.choices]
    singles_text = [a.choices[0].text, other.choices[0].text, ninth.choices[0].text]
    print(f"choice i equals the lone answer of seed + i: {texts == singles_text}")
    assert three.usage is not None and a.usage and other.usage and ninth.usage
    assert three.usage.prompt_tokens == a.usage.prompt_tokens  # the prompt counts once
    if text.own:  # choice i is the generation with seed + i
        assert texts == singles_text
        singles = [a.usage, other.usage, ninth.usage]
        assert three.usage.completion_tokens == sum(u.completion_tokens for u in singles)
    else:
        # vLLM seeds choice i with seed + i too, but decodes the n choices as one batch, whose
        # bf16 kernels may break a near-tie of random weights otherwise than a lone request's
        # (in 2 of 4 GPU runs): held as the same n request answering the same, with
        # distinct choices.
        again = await ask(7, n=3)
        assert [c.text for c in again.choices] == texts
        assert len(set(texts)) == 3
        assert again.usage is not None
        assert again.usage.completion_tokens == three.usage.completion_tokens
    streamed = await api.chat.completions.create(
        model=model,
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


async def test_logprobs(text: Text) -> None:
    """Greedy answers' log probabilities. ``top_logprobs`` maps token texts to values, so two
    tokens with the same text (bytes of an unfinished character, both shown as U+FFFD) share an
    entry; the legacy API may add the sampled token to the ``logprobs`` most likely."""
    api, model = text.api, text.model
    done = await api.completions.create(
        model=model, prompt="the cat", max_tokens=4, logprobs=3, temperature=0
    )
    logprobs = done.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and done.usage is not None
    assert len(logprobs.tokens) == done.usage.completion_tokens
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert all(1 <= len(top) <= 3 + 1 for top in logprobs.top_logprobs)
    for token, value, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert value <= 0 and token in top
        assert max(top.values()) <= value + 1e-4  # greedy: the chosen token is the most likely
    chat = await api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and chat.usage is not None
    assert len(content.content) == chat.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 for t in content.content)
    for entry in content.content:
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
    plain = await api.completions.create(model=model, prompt="the cat", max_tokens=2)
    assert plain.choices[0].logprobs is None


async def test_streamed_logprobs_come_with_their_tokens(text: Text) -> None:
    """Each streamed chunk with text carries its tokens' log probabilities (not all in the
    last chunk); together they equal the unstreamed answer's, offsets included."""
    api, model = text.api, text.model
    whole = await api.completions.create(
        model=model, prompt="the cat", max_tokens=6, logprobs=2, temperature=0
    )
    expected = whole.choices[0].logprobs
    assert expected is not None and expected.tokens is not None
    streamed = await api.completions.create(
        model=model, prompt="the cat", max_tokens=6, logprobs=2, temperature=0, stream=True
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
    assert values == pytest.approx(expected.token_logprobs, abs=1e-4)
    # Another server's offsets are compared where its tokens spell the text: a token holding
    # part of a character (a byte-level tokenizer's) shows as U+FFFD and has no place of its own.
    if text.own or "".join(expected.tokens) == whole.choices[0].text:
        assert offsets == expected.text_offset
    chat = await api.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "the cat"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=1,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    entries = []
    used = None
    async for part in chat:
        if part.choices and part.choices[0].logprobs and part.choices[0].logprobs.content:
            entries.append(len(part.choices[0].logprobs.content))
        used = part.usage or used
    assert used is not None
    assert len(entries) > 1 and sum(entries) == used.completion_tokens


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


Refusal = Callable[[openai.AsyncOpenAI, str], Awaitable[Any]]
#: Fields the torch stage cannot honour (the calls ask for 2 tokens, so a server that honours
#: them answers quickly).
REFUSED: list[tuple[str, Refusal]] = [
    (
        "tools",
        lambda c, m: c.chat.completions.create(
            model=m,
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=2,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        ),
    ),
    (
        "response_format",
        lambda c, m: c.chat.completions.create(
            model=m,
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=2,
            response_format={"type": "json_object"},
        ),
    ),
    (
        "logit_bias",
        lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, logit_bias={"1": 5}),
    ),
    (
        "presence_penalty",
        lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, presence_penalty=0.5),
    ),
    ("echo", lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, echo=True)),
    ("suffix", lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, suffix="y")),
    ("best_of", lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, best_of=3)),
    (
        "modalities",
        lambda c, m: c.chat.completions.create(
            model=m,
            messages=[{"role": "user", "content": "x"}],
            max_completion_tokens=2,
            modalities=["audio"],
        ),
    ),
    (
        "frobnicate",
        lambda c, m: c.completions.create(
            model=m, prompt="x", max_tokens=2, extra_body={"frobnicate": 1}
        ),
    ),
    (
        "stop",
        lambda c, m: c.completions.create(
            model=m, prompt="x", max_tokens=2, stop=["a", "b", "c", "d", "e"]
        ),
    ),
    ("max_tokens", lambda c, m: c.completions.create(model=m, prompt="the cat", max_tokens=127)),
    (
        "max_completion_tokens",
        lambda c, m: c.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "x"}], max_completion_tokens=500
        ),
    ),
    ("top_p", lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, top_p=1.5)),
    ("logprobs", lambda c, m: c.completions.create(model=m, prompt="x", max_tokens=2, logprobs=21)),
]
#: values outside the API's own ranges: every server refuses them (the others a server may honour)
INVALID = {"top_p", "logprobs"}
#: fields vLLM's request models do not define (vLLM itself would serve without them): a vLLM
#: stage's front refuses them, naming them
UNKNOWN_TO_VLLM = {"best_of", "modalities", "frobnicate"}


@pytest.mark.parametrize(("param", "call"), REFUSED, ids=[p for p, _ in REFUSED])
async def test_a_field_the_stage_cannot_honour_is_refused_naming_it(
    text: Text, param: str, call: Refusal
) -> None:
    """This project's stages refuse every field they cannot honour, naming it, in OpenAI's
    error shape. Another server (vLLM) honours some of them: it must answer those or refuse
    them as a 400, and refuse the invalid values; what it did is printed."""
    if not text.own and param not in INVALID | UNKNOWN_TO_VLLM:
        try:
            await call(text.api, text.model)
        except openai.BadRequestError as exc:
            print(f"{param}: refused, {exc.body}")
        else:
            print(f"{param}: answered")
        return
    with pytest.raises(openai.BadRequestError) as info:
        await call(text.api, text.model)
    print(f"{param}: refused, {info.value.body}")
    if text.own or param in UNKNOWN_TO_VLLM:
        assert info.value.body["param"] == param  # type: ignore[index]
        assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_a_length_past_the_context_is_refused(text: Text) -> None:
    api, model = text.api, text.model
    asks: list[tuple[str, Callable[[], Awaitable[Any]]]] = [
        (
            "max_tokens",
            lambda: api.completions.create(model=model, prompt="the cat", max_tokens=10**6),
        ),
        (
            "max_completion_tokens",
            lambda: api.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "x"}],
                max_completion_tokens=10**6,
            ),
        ),
    ]
    for param, ask in asks:
        with pytest.raises(openai.BadRequestError) as info:
            await ask()
        print(f"{param}: refused, {info.value.body}")
        if text.own:
            assert info.value.body["param"] == param  # type: ignore[index]


async def test_unknown_model_is_not_found(text: Text) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await text.api.completions.create(model="nope", prompt="x")
    print(info.value.body)
    if text.own:
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
