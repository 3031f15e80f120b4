"""The conformance suite's refusals and errors: every field a stage cannot honour refused with
400 naming it, lengths past the context, unknown models, worker states mapped to the ``openai``
client's exception classes, and the bearer token on a stage and the router (the text part is in
``test_openai_conformance.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from omnistage_worker.serving.router import Router
from tests.worker import openai_targets
from tests.worker.conftest import StartWorker, wait_for
from tests.worker.openai_targets import (
    MODEL,
    TOKEN,
    Text,
    base,
    client,
    serve,
)

# The suite's fixtures, found by pytest under their own names: _close_clients, stages (which
# text starts for the torch and router targets), text.
_close_clients = openai_targets.close_clients
_stages_fixture = openai_targets.stages_fixture
_text_fixture = openai_targets.text_fixture

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
