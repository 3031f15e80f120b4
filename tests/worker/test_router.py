"""The group router sends each OpenAI request to the stage its ``model`` names."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import time
from pathlib import Path

import grpc
import httpx
import pytest

from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc
from omnistage_worker.serving.router import Router, parse_routes
from tests.worker.cli_process import Subprocess, spawn
from tests.worker.conftest import StartWorker, wait_for
from tests.worker.openai_targets import base as url
from tests.worker.openai_targets import serve

__all__ = ["spawn"]  # the fixture, used here


async def test_requests_go_to_the_stage_named_by_model(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    awake = await start_worker(lm_dir, "ar", "transformers", http_port=0, served_model_name="one")
    lazy = await start_worker(
        lm_dir, "ar", "transformers", http_port=0, served_model_name="two",
        activation="ondemand", initial_state="asleep",
    )  # fmt: skip
    routes = {"one": [url(awake)], "two": [url(lazy)], "gone": ["http://127.0.0.1:9"]}
    router = Router(routes, retry_within=0.5)
    async with serve(router.asgi) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:
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


def _http_port(proc: Subprocess, within: float = 60.0) -> int:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        match = re.search(r"OpenAI-compatible HTTP on [\d.]+:(\d+)", proc.log.read_text())
        if match:
            return int(match.group(1))
        time.sleep(0.05)
    raise AssertionError(f"no HTTP port in the worker's log:\n{proc.log.read_text()}")


def _lm_worker(lm_dir: Path, log: Path, *extra: str) -> Subprocess:
    return Subprocess(
        [
            "--runner", "ar", "--backend", "transformers", "--model", str(lm_dir),
            "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
            "--served-model-name", "lm", "--shutdown-grace", "30", *extra,
        ],
        log,
    )  # fmt: skip


async def test_a_going_worker_answers_its_held_requests_and_the_router_sends_them_on(
    lm_dir: Path, tmp_path: Path, spawn: list[Subprocess]
) -> None:
    """Real worker processes: SIGTERM to one answers what it held (503, unserved); the router
    sends those requests to the stage's next pod, and one that cannot reach a pod too."""
    going = _lm_worker(lm_dir, tmp_path / "going.log", "--activation", "ondemand",
                       "--initial-state", "asleep")  # fmt: skip
    staying = _lm_worker(lm_dir, tmp_path / "staying.log")
    spawn.extend([going, staying])
    going_url = f"http://127.0.0.1:{_http_port(going)}"
    staying_url = f"http://127.0.0.1:{_http_port(staying)}"
    grpc_port = going.port()
    router = Router({"lm": [going_url, staying_url]})
    body = {"model": "lm", "prompt": "the cat", "max_tokens": 3}
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
    async with serve(router.asgi) as base, httpx.AsyncClient(base_url=base, timeout=60) as http:

        async def both_up() -> bool:
            for url in (going_url, staying_url):
                try:
                    health = (await http.get(f"{url}/health")).json()
                except httpx.HTTPError:
                    return False
                if health["state"] not in ("WORKER_STATE_ASLEEP", "WORKER_STATE_ACTIVE"):
                    return False
            return True

        await wait_for(both_up, within=60, what="both workers loaded")
        expected = (await http.post(f"{staying_url}/v1/completions", json=body)).json()
        routed = [
            asyncio.ensure_future(http.post("/v1/completions", json={**body, "stream": s}))
            for s in (False, True)
        ]
        stub = inference_service_pb2_grpc.InferenceServiceStub(channel)
        grpc_held = asyncio.ensure_future(
            stub.Generate(inference_service_pb2.GenerateRequest(prompt="the cat"))
        )

        async def three_held() -> bool:
            held: int = (await http.get(f"{going_url}/health")).json()["held_requests"]
            return held == 3

        await wait_for(three_held, what="three requests held by the asleep worker")
        signalled = time.monotonic()
        going.proc.send_signal(signal.SIGTERM)
        plain, streamed = await asyncio.gather(*routed)
        assert plain.status_code == 200, plain.text
        assert plain.json()["choices"][0]["text"] == expected["choices"][0]["text"]
        assert streamed.status_code == 200 and streamed.text.rstrip().endswith("[DONE]")
        assert router.retried == 2
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await grpc_held
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ("retry-after", "1") in tuple(info.value.trailing_metadata() or ())
        code = await asyncio.to_thread(going.proc.wait, 30)
        assert code == 0, going.log.read_text()
        # Within the fence's grace (5 s) on a loaded machine: nothing ran, nothing waited.
        took = time.monotonic() - signalled
        print(f"SIGTERM to exit: {took:.2f}s")
        assert took < 5.0
        assert "3 held or queued requests answered" in going.log.read_text()
        # The pod is gone: its connection is refused, the request goes to the next one.
        after = await http.post("/v1/completions", json=body)
        assert after.status_code == 200 and router.retried == 3
    await channel.close()


async def test_behind_one_url_a_request_waits_for_the_next_pod(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    """One Service URL and no pod behind it yet (the old one went): the request is sent again
    until the next pod answers, within the router's retry window."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    router = Router({"lm": [f"http://127.0.0.1:{port}"]}, retry_within=60.0)
    async with serve(router.asgi) as base, httpx.AsyncClient(base_url=base, timeout=90) as http:
        sent = asyncio.ensure_future(
            http.post("/v1/completions", json={"model": "lm", "prompt": "the cat", "max_tokens": 2})
        )

        async def retried() -> bool:
            return router.retried >= 2

        await wait_for(retried, what="the router to send the request again")
        assert not sent.done()
        await start_worker(lm_dir, "ar", "transformers", http_port=port, served_model_name="lm")
        answer = await sent
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 2
