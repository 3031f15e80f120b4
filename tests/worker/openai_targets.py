"""The targets of the ``openai``-client conformance suite (``test_openai_conformance*.py``):
the tiny torch AR and diffusion stages, the group router in front of them, a running vLLM stage
named by the environment, the clients that reach them, and the checks the tests share."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest
import uvicorn

from omnistage_worker.serving.router import Router
from tests.worker.conftest import StartWorker, WorkerHandle

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


@pytest.fixture(name="_close_clients", autouse=True)
async def close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await _OPEN.pop().close()


@dataclass
class Stages:
    lm: WorkerHandle
    sd: WorkerHandle
    router: str


@pytest.fixture(name="stages")
async def stages_fixture(
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


@pytest.fixture(name="text", params=TEXT_TARGETS)
def text_fixture(request: pytest.FixtureRequest) -> Text:
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
