"""The router serves a pipeline under its name: each OpenAI request runs through the stages
(real workers over gRPC, tiny real models) and equals the same pipeline run in one process."""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path

import httpx
import pytest

from omnistage_worker.serving.pipeline_def import Passes, PipelineDef, PipelineStage, parse_pipeline
from omnistage_worker.serving.pipeline_serve import PipelineServer, grpc_targets
from omnistage_worker.serving.router import Router
from tests.worker.conftest import StartWorker, WorkerHandle, wait_for
from tests.worker.openai_targets import serve
from tests.worker.pipeline_reference import InProcessPipeline
from tests.worker.test_embeds import encoder_dir

__all__ = ["encoder_dir"]  # the fixture, used here

FIELDS = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 1.0}
BODY = {"size": "32x32", "num_inference_steps": 4, "guidance_scale": 1.0}


def test_pipeline_flags() -> None:
    got = parse_pipeline("qwen-image=qwen-encoder:embeds,qwen-dit")
    assert got == PipelineDef(
        "qwen-image", (PipelineStage("qwen-encoder", Passes.EMBEDS), PipelineStage("qwen-dit"))
    )
    assert parse_pipeline("p=a:text,b:text,c").stages[1] == PipelineStage("b", Passes.TEXT)
    for bad, reason in (
        ("p", "use NAME=STAGE:embeds,STAGE"),
        ("p=a:embeds", "2 to 8 stages, got 1"),
        ("p=a,b", "stage 'a' must say what it passes"),
        ("p=a:pickle,b", "stage 'a' must say what it passes"),
        ("p=a:text,b:text", "the last stage passes nothing on"),
        ("p=a:text,a", "a stage appears twice"),
        ("P=a:text,b", "use NAME="),
    ):
        with pytest.raises(ValueError, match=reason):
            parse_pipeline(bad)
    targets = grpc_targets([got], "ns", 50051, {"qwen-dit": "10.0.0.1:1"})
    assert targets == {"qwen-dit": "10.0.0.1:1", "qwen-encoder": "qwen-encoder-worker.ns.svc:50051"}


def _grpc(worker: WorkerHandle) -> str:
    return f"127.0.0.1:{worker.server.port}"


def _router(pipeline: str, workers: dict[str, WorkerHandle]) -> Router:
    defn = parse_pipeline(pipeline)
    targets = {name: _grpc(w) for name, w in workers.items()}
    return Router({}, pipelines={defn.name: PipelineServer(defn, targets)})


def _png(answer: httpx.Response) -> list[bytes]:
    assert answer.status_code == 200, answer.text
    return [base64.b64decode(d["b64_json"]) for d in answer.json()["data"]]


async def test_image_pipeline_equals_one_process(
    start_worker: StartWorker, encoder_dir: Path, diffusion_dir: Path
) -> None:
    encoder = await start_worker(encoder_dir, "ar", "transformers")
    dit = await start_worker(diffusion_dir, "diffusion", "diffusers", max_batch=4)
    router = _router("tiny-image=enc:embeds,dit", {"enc": encoder, "dit": dit})
    reference = InProcessPipeline(encoder_dir, diffusion_dir)
    prompts = ["the cat sat on the mat", "a bird can fly over the tree", "we like to read books"]
    async with serve(router.asgi) as base, httpx.AsyncClient(base_url=base, timeout=120) as http:
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny-image"]
        first = await http.post(
            "/v1/images/generations",
            json={"model": "tiny-image", "prompt": prompts[0], "seed": 5, **BODY},
        )
        assert _png(first) == reference.images(prompts[:1], [5], FIELDS)
        usage = first.json()["usage"]  # the prompt as the encoder counted it: 6 words
        assert (usage["input_tokens"], usage["images"], usage["steps"]) == (6, 1, 4)
        # n=2: seeds 9 and 10, concurrently through both stages
        two = _png(
            await http.post(
                "/v1/images/generations",
                json={"model": "tiny-image", "prompt": prompts[1], "seed": 9, "n": 2, **BODY},
            )
        )
        assert len(two) == 2 and two[0] != two[1]
        # several clients at once: each its own request through the pipeline
        answers = await asyncio.gather(
            *(
                http.post(
                    "/v1/images/generations",
                    json={"model": "tiny-image", "prompt": p, "seed": 1, **BODY},
                )
                for p in prompts
            )
        )
        from tests.worker.test_diffusion_batching import assert_same_image

        expected = reference.images(prompts, [1, 1, 1], FIELDS)
        for answer, want in zip(answers, expected, strict=True):
            assert_same_image(_png(answer)[0], want)  # a batched call may round a pixel

        bad_size = await http.post(
            "/v1/images/generations",
            json={"model": "tiny-image", "prompt": "the cat", **{**BODY, "size": "33x33"}},
        )
        error = bad_size.json()["error"]
        assert bad_size.status_code == 400 and error["param"] == "size", error
        assert error["message"].startswith("pipeline 'tiny-image', stage 'dit': height: 33")
        text = await http.post(
            "/v1/chat/completions",
            json={"model": "tiny-image", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert text.status_code == 400 and "makes images" in text.json()["error"]["message"]


async def test_text_pipeline_and_mismatched_stages(
    start_worker: StartWorker, lm_dir: Path, diffusion_dir: Path
) -> None:
    lm = await start_worker(lm_dir, "ar", "transformers")  # hidden width 32: not the UNet's 16
    dit = await start_worker(diffusion_dir, "diffusion", "diffusers")
    text = parse_pipeline("rewrite=lm:text,dit")
    wrong = parse_pipeline("wrong=lm:embeds,dit")
    targets = {"lm": _grpc(lm), "dit": _grpc(dit)}
    router = Router({}, pipelines={p.name: PipelineServer(p, targets) for p in (text, wrong)})
    async with serve(router.asgi) as base, httpx.AsyncClient(base_url=base, timeout=120) as http:
        got = _png(
            await http.post(
                "/v1/images/generations",
                json={"model": "rewrite", "prompt": "the cat", "seed": 3, **BODY},
            )
        )
        written = await lm.generate(prompt="the cat", seed=3, request_id="r")
        direct = await dit.generate(prompt=written.text.text, seed=3, **FIELDS)
        assert got == [direct.image.png]
        mismatch = await http.post(
            "/v1/images/generations",
            json={"model": "wrong", "prompt": "the cat", "seed": 3, **BODY},
        )
        error = mismatch.json()["error"]
        assert mismatch.status_code == 500 and error["code"] == "pipeline_mismatch", error
        assert "hidden width 32 is not StableDiffusionPipeline's 16" in error["message"]
        assert "stage 'lm'" in error["message"] and "stage 'dit'" in error["message"]
        empty = await http.post(
            "/v1/images/generations", json={"model": "rewrite", "prompt": "", **BODY}
        )
        assert empty.status_code == 400 and empty.json()["error"]["param"] == "prompt"


async def test_a_stage_not_reachable_yet_is_called_again(
    start_worker: StartWorker, encoder_dir: Path, diffusion_dir: Path
) -> None:
    """The DiT's pod is being replaced (nothing listens at its address for a moment): the
    router sends the call again until it answers, within --retry-within."""
    from omnistage_worker.config import WorkerConfig
    from omnistage_worker.serving.server import WorkerServer
    from tests.cluster.procs import free_port

    encoder = await start_worker(encoder_dir, "ar", "transformers")
    port = free_port()
    defn = parse_pipeline("late=enc:embeds,dit")
    server = PipelineServer(defn, {"enc": _grpc(encoder), "dit": f"127.0.0.1:{port}"}, 60.0)
    router = Router({}, pipelines={"late": server})
    config = WorkerConfig(
        runner="diffusion", backend="diffusers", model=diffusion_dir, host="127.0.0.1", port=port
    )
    late = WorkerServer(config)
    try:
        async with (
            serve(router.asgi) as base,
            httpx.AsyncClient(base_url=base, timeout=120) as http,
        ):
            body = {"model": "late", "prompt": "the cat", "seed": 2, **BODY}
            answer = asyncio.ensure_future(http.post("/v1/images/generations", json=body))

            async def retried() -> bool:
                return server.retried >= 1

            await wait_for(retried, within=30, what="a call sent again")
            await late.start()
            got = await answer
            assert got.status_code == 200, got.text
            assert _png(got)[0]
    finally:
        await late.stop(1.0)


async def test_a_text_pipeline_streams_its_last_stage(
    start_worker: StartWorker, lm_dir: Path
) -> None:
    first = await start_worker(lm_dir, "ar", "transformers")
    second = await start_worker(lm_dir, "ar", "transformers")
    defn = parse_pipeline("chain=first:text,second")
    server = PipelineServer(defn, {"first": _grpc(first), "second": _grpc(second)})
    router = Router({}, pipelines={"chain": server})
    chat = {"model": "chain", "messages": [{"role": "user", "content": "the cat"}], "seed": 1}
    async with serve(router.asgi) as base, httpx.AsyncClient(base_url=base, timeout=120) as http:
        whole = await http.post("/v1/chat/completions", json={**chat, "max_tokens": 6})
        assert whole.status_code == 200, whole.text
        content = whole.json()["choices"][0]["message"]["content"]
        stream = await http.post(
            "/v1/chat/completions", json={**chat, "max_tokens": 6, "stream": True}
        )
        assert stream.status_code == 200, stream.text
        events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        deltas = [c["choices"][0]["delta"].get("content", "") for c in chunks]
        assert len([d for d in deltas if d]) >= 2  # token by token, not one piece
        assert "".join(deltas) == content
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
