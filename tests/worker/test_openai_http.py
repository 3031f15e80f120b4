"""The OpenAI-compatible HTTP API of a worker, over a real uvicorn socket."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Any

import httpx

from tests.worker.conftest import StartWorker, WorkerHandle, wait_for


def client(worker: WorkerHandle) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=f"http://127.0.0.1:{worker.server.http_port}", timeout=60)


async def lm_http(start_worker: StartWorker, lm_dir: Path, **overrides: Any) -> WorkerHandle:
    overrides.setdefault("served_model_name", "tiny-lm")
    return await start_worker(lm_dir, "ar", "transformers", http_port=0, **overrides)


def sse_events(body: str) -> list[Any]:
    events = [line.removeprefix("data: ") for line in body.split("\n\n") if line]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


async def test_models_health_and_a_completion(start_worker: StartWorker, lm_dir: Path) -> None:
    worker = await lm_http(start_worker, lm_dir)
    async with client(worker) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-lm"]
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["state"] == "WORKER_STATE_ACTIVE"
        answer = await http.post(
            "/v1/completions", json={"model": "tiny-lm", "prompt": "the cat", "max_tokens": 3}
        )
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert float(answer.headers["x-omnistage-held-ms"]) < 1000  # awake: never held
        assert body["object"] == "text_completion"
        assert body["choices"][0]["finish_reason"] == "length"
        grpc_answer = await worker.generate(prompt="the cat", max_new_tokens=3)
        assert body["choices"][0]["text"] == grpc_answer.text.text


async def test_streamed_completion_and_chat_are_sse(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await lm_http(start_worker, lm_dir)
    async with client(worker) as http:
        whole = (await http.post("/v1/completions", json={"prompt": "a b", "max_tokens": 4})).json()
        streamed = await http.post(
            "/v1/completions", json={"prompt": "a b", "max_tokens": 4, "stream": True}
        )
        assert streamed.headers["content-type"].startswith("text/event-stream")
        events = sse_events(streamed.text)
        assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        chat = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True},
        )
        chunks = sse_events(chat.text)
        assert chunks[0]["object"] == "chat.completion.chunk"
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        plain = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        message = plain.json()["choices"][0]["message"]
        streamed_text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
        assert message == {"role": "assistant", "content": streamed_text, "refusal": None}


async def test_errors_use_the_openai_shape(start_worker: StartWorker, lm_dir: Path) -> None:
    worker = await lm_http(start_worker, lm_dir)
    async with client(worker) as http:
        wrong = await http.post("/v1/completions", json={"model": "other", "prompt": "x"})
        assert wrong.status_code == 404
        assert wrong.json()["error"]["code"] == "model_not_found"
        bad = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "max_tokens"
        too_many = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 10**6})
        assert too_many.status_code == 400
        assert too_many.json()["error"]["param"] == "max_tokens"
        images = await http.post("/v1/images/generations", json={"prompt": "x"})
        assert images.status_code == 400 and "serves text" in images.json()["error"]["message"]
        nothing = await http.get("/v1/nothing")
        assert nothing.status_code == 404 and "error" in nothing.json()


async def test_a_held_request_is_served_after_the_wake(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    worker = await lm_http(start_worker, lm_dir, activation="ondemand", initial_state="asleep")
    async with client(worker) as http:
        streamed = asyncio.ensure_future(
            http.post("/v1/completions", json={"prompt": "a", "max_tokens": 2, "stream": True})
        )

        async def held() -> bool:
            return worker.server.worker.demand.held == 1

        await wait_for(held, what="the request held")
        assert (await http.get("/health")).json()["held_requests"] == 1
        assert (await worker.wake()).ok
        response = await streamed
        assert response.status_code == 200
        assert float(response.headers["x-omnistage-held-ms"]) > 0  # held until the wake
        assert sse_events(response.text)[-1]["choices"][0]["finish_reason"] == "length"


async def test_503_with_retry_after_past_the_hold_timeout_409_when_manual(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    held = await lm_http(
        start_worker, lm_dir, activation="ondemand", initial_state="asleep", hold_timeout_s=0.2
    )
    manual = await lm_http(start_worker, lm_dir, initial_state="asleep")
    async with client(held) as http:
        answer = await http.post("/v1/completions", json={"prompt": "a", "stream": True})
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == "1"
        assert answer.json()["error"]["code"] == "hold_timeout"
    async with client(manual) as http:
        answer = await http.post("/v1/completions", json={"prompt": "a"})
        assert answer.status_code == 409
        assert answer.json()["error"]["message"] == "worker is asleep (level 1)"


async def test_images_for_a_diffusion_stage(start_worker: StartWorker, diffusion_dir: Path) -> None:
    worker = await start_worker(diffusion_dir, "diffusion", "diffusers", http_port=0)
    async with client(worker) as http:
        answer = await http.post(
            "/v1/images/generations",
            json={"prompt": "a red square", "size": "64x64", "num_inference_steps": 2},
        )
        assert answer.status_code == 200, answer.text
        png = base64.b64decode(answer.json()["data"][0]["b64_json"])
        assert png.startswith(b"\x89PNG")
        text = await http.post("/v1/completions", json={"prompt": "x"})
        assert text.status_code == 400
