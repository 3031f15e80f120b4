"""The group router sends each OpenAI request to the stage its ``model`` names."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from omnistage_worker.router import Router, parse_routes
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for


@contextlib.asynccontextmanager
async def serve(router: Router) -> AsyncIterator[str]:
    config = uvicorn.Config(router.app, host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    task = asyncio.ensure_future(server.serve())
    while not server.started:  # noqa: ASYNC110 - uvicorn has no "started" event to await
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def url(worker: WorkerHandle) -> str:
    return f"http://127.0.0.1:{worker.server.http_port}"


async def test_requests_go_to_the_stage_named_by_model(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    awake = await start_worker(lm_dir, "ar", "transformers", http_port=0, served_model_name="one")
    lazy = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, served_model_name="two",
        activation="ondemand", initial_state="asleep",
    )  # fmt: skip
    router = Router({"one": [url(awake)], "two": [url(lazy)], "gone": ["http://127.0.0.1:9"]})
    async with serve(router) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["gone", "one", "two"]
        one = await http.post(
            "/v1/completions", json={"model": "one", "prompt": "a", "max_tokens": 2}
        )
        assert one.status_code == 200 and one.json()["model"] == "one"
        # a held request passes through the router, and its stream once the stage wakes
        held = asyncio.ensure_future(
            http.post(
                "/v1/chat/completions",
                json={"model": "two", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 2, "stream": True},
            )
        )  # fmt: skip

        async def is_held() -> bool:
            return lazy.server.worker.demand.held == 1

        await wait_for(is_held, what="the routed request held by its stage")
        await lazy.wake()
        answer = await held
        assert answer.status_code == 200
        assert answer.text.rstrip().endswith("data: [DONE]")
        assert float(answer.headers["x-omnistage-held-ms"]) > 0
        unknown = await http.post("/v1/completions", json={"model": "three", "prompt": "a"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        down = await http.post("/v1/completions", json={"model": "gone", "prompt": "a"})
        assert down.status_code == 502 and "cannot be reached" in down.json()["error"]["message"]


def test_routing_table_from_flags() -> None:
    assert parse_routes("ns", ["a"], 8000, ["b=http://b:1/", "b=http://b2:1"]) == {
        "a": ["http://a-worker.ns.svc:8000"],
        "b": ["http://b:1", "http://b2:1"],
    }
    with pytest.raises(ValueError, match="NAME=http"):
        parse_routes("ns", [], 8000, ["b"])
    with pytest.raises(ValueError, match="at least one"):
        parse_routes("ns", [], 8000, [])
