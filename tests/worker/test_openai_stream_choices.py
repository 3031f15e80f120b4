"""Streamed answers with ``n`` > 1 and ``stream_options.include_usage`` from the torch stage,
read with the official (pinned) ``openai`` client, directly and through the router (issue 18).

Each choice arrives as its own chunks (its index on every chunk, one finish reason each) and
adds up to the unstreamed answer's text for the same seed; exactly one usage chunk comes, last,
with no choices, counting the prompt once and every choice's tokens.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest

from omnistage_worker.serving.router import Router
from tests.worker import openai_targets
from tests.worker.conftest import StartWorker
from tests.worker.openai_targets import MODEL, base, client, serve

# Closes the clients this module opens (else the next module that closes them finds their loop
# closed).
_close_clients = openai_targets.close_clients

pytestmark = [pytest.mark.timeout(180)]


@pytest.fixture(params=["torch", "router"])
async def text(
    request: pytest.FixtureRequest, start_worker: StartWorker, lm_dir: Path
) -> AsyncIterator[openai.AsyncOpenAI]:
    lm = await start_worker(lm_dir, "ar", "transformers", http_port=0, served_model_name=MODEL)
    if request.param == "torch":
        yield client(base(lm))
        return
    async with serve(Router({MODEL: [base(lm)]}).asgi) as router:
        yield client(router)


def _by_choice(chunks: list[Any], chat: bool) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Each choice's streamed text and the finish reasons its chunks carried."""
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
    return texts, finishes


def _check_usage_chunk(chunks: list[Any], prompt: int, completion: int) -> None:
    with_usage = [i for i, c in enumerate(chunks) if c.usage is not None]
    assert with_usage == [len(chunks) - 1], "exactly one usage chunk, the last"
    last = chunks[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (prompt, completion)
    assert last.usage.total_tokens == prompt + completion


async def test_streamed_completion_choices_and_one_usage_chunk(text: openai.AsyncOpenAI) -> None:
    ask: dict[str, Any] = {"model": MODEL, "prompt": "the cat", "max_tokens": 5,
                           "temperature": 1.0, "seed": 11, "n": 3}  # fmt: skip
    whole = await text.completions.create(**ask)
    stream = await text.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    texts, finishes = _by_choice(chunks, chat=False)
    assert texts == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    assert set(texts) == {0, 1, 2}
    assert len({c.id for c in chunks}) == 1
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == 2  # the prompt counts once
    _check_usage_chunk(chunks, whole.usage.prompt_tokens, whole.usage.completion_tokens)


async def test_streamed_chat_choices_and_one_usage_chunk(text: openai.AsyncOpenAI) -> None:
    ask: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "the cat"}],
                           "max_tokens": 4, "temperature": 1.0, "seed": 5, "n": 2}  # fmt: skip
    whole = await text.chat.completions.create(**ask)
    stream = await text.chat.completions.create(
        **ask, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    texts, finishes = _by_choice(chunks, chat=True)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: [c.finish_reason] for c in whole.choices}
    assert set(texts) == {0, 1}
    roles = {(ch.index, ch.delta.role) for c in chunks for ch in c.choices if ch.delta.role}
    assert roles == {(0, "assistant"), (1, "assistant")}  # each choice's first chunk
    assert whole.usage is not None
    _check_usage_chunk(chunks, whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # Without include_usage: per-choice chunks still, and no usage anywhere.
    plain = [c async for c in await text.chat.completions.create(**ask, stream=True)]
    assert all(c.usage is None and c.choices for c in plain)
    assert _by_choice(plain, chat=True)[0] == texts
