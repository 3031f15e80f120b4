"""Prompt embeds between pipeline stages: an AR stage's Encode (its last hidden state) feeds a
diffusion stage's ``prompt_embeds``, as safetensors bytes checked against their declaration
(tiny real models over real gRPC; outputs equal the same models run in this process)."""

from __future__ import annotations

import asyncio
import json
import pickle
import struct
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.runners.base import InvalidRequest
from omnistage_worker.runners.embeds import check_header, pack, unpack
from tests.worker.conftest import StartWorker, WorkerHandle, rpc_error, wait_for
from tests.worker.tiny_models import build_causal_lm

PE = inference_service_pb2.PromptEmbeds
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture(scope="module")
def encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama whose hidden width (16) is the tiny SD UNet's cross-attention width."""
    return build_causal_lm(
        tmp_path_factory.mktemp("models") / "tiny-encoder", hidden_size=16, intermediate_size=32
    )


def _raw(header: dict[str, object], data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_pack_round_trip_and_checks() -> None:
    embeds = torch.randn(5, 8)
    message = pack(embeds, torch.tensor([1, 1, 1, 1, 0]))
    assert (list(message.shape), message.dtype) == ([5, 8], "F32")
    got, mask = unpack(message)
    assert torch.equal(got, embeds) and mask.tolist() == [1, 1, 1, 1, 0]
    half = pack(embeds.to(torch.bfloat16), torch.ones(5))
    assert half.dtype == "BF16" and unpack(half)[0].dtype == torch.bfloat16

    good = message.safetensors
    cases: list[tuple[PE, str]] = [
        (PE(safetensors=good, shape=[5, 8], dtype="F64"), "dtype 'F64' is not one of"),
        (PE(safetensors=good, shape=[5, 8, 1], dtype="F32"), "shape [5, 8, 1] is not"),
        (PE(safetensors=good, shape=[5, 9], dtype="F32"), "prompt_embeds is F32 [5, 8], declared"),
        (PE(safetensors=good, shape=[5, 8], dtype="F16"), "prompt_embeds is F32 [5, 8], declared"),
        (PE(safetensors=good[:-4], shape=[5, 8], dtype="F32"), "data bytes, declared"),
        (PE(safetensors=b"", shape=[5, 8], dtype="F32"), "shorter than its header"),
        (
            PE(safetensors=pickle.dumps({"x": 1}), shape=[5, 8], dtype="F32"),
            "header length",
        ),
    ]
    extra = _raw(
        {
            "prompt_embeds": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]},
            "prompt_embeds_mask": {"dtype": "I64", "shape": [1], "data_offsets": [4, 12]},
            "other": {"dtype": "F32", "shape": [1], "data_offsets": [12, 16]},
        },
        bytes(16),
    )
    cases.append((PE(safetensors=extra, shape=[1, 1], dtype="F32"), "the file holds ['other'"))
    lying = _raw(
        {
            "prompt_embeds": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 400]},
            "prompt_embeds_mask": {"dtype": "I64", "shape": [1], "data_offsets": [400, 408]},
        },
        bytes(408),
    )
    cases.append((PE(safetensors=lying, shape=[1, 1], dtype="F32"), "data offsets [0, 400]"))
    for bad, message_start in cases:
        with pytest.raises(InvalidRequest) as info:
            check_header(bad)
        assert str(info.value).startswith("prompt_embeds: "), str(info.value)
        assert message_start in str(info.value), str(info.value)
    with pytest.raises(InvalidRequest, match="above this stage's limit of 100"):
        check_header(message, limit=100)
    with pytest.raises(InvalidRequest, match="not finite"):
        unpack(pack(torch.full((2, 2), float("nan")), torch.ones(2)))
    with pytest.raises(InvalidRequest, match="mask covers no token"):
        unpack(pack(torch.ones(2, 2), torch.zeros(2)))


async def _encode(worker: WorkerHandle, prompt: str) -> inference_service_pb2.EncodeResponse:
    response: inference_service_pb2.EncodeResponse = await worker.inference_stub.Encode(
        inference_service_pb2.EncodeRequest(request_id=prompt, prompt=prompt)
    )
    return response


async def test_encode_feeds_diffusion_like_one_process(
    start_worker: StartWorker, encoder_dir: Path, diffusion_dir: Path
) -> None:
    from diffusers import StableDiffusionPipeline
    from transformers import AutoModelForCausalLM, AutoTokenizer

    encoder = await start_worker(encoder_dir, "ar", "transformers")
    dit = await start_worker(diffusion_dir, "diffusion", "diffusers", max_batch=4)
    prompts = ["the cat sat on the mat", "a dog ran in the park"]
    encoded = [await _encode(encoder, p) for p in prompts]
    first = encoded[0]
    assert first.request_id == prompts[0] and first.usage.prompt_tokens == 6
    assert (list(first.prompt_embeds.shape), first.prompt_embeds.dtype) == ([6, 16], "F32")

    # The same models in this process, on the same inputs: the same bits.
    model = AutoModelForCausalLM.from_pretrained(str(encoder_dir), local_files_only=True)
    model.eval()  # type: ignore[no-untyped-call]
    tokenizer = AutoTokenizer.from_pretrained(str(encoder_dir), local_files_only=True)
    with torch.inference_mode():
        ids = torch.tensor([tokenizer(prompts[0])["input_ids"]])
        hidden = model.base_model(input_ids=ids).last_hidden_state[0]
    assert torch.equal(unpack(first.prompt_embeds)[0], hidden)

    fields = {"height": 32, "width": 32, "num_inference_steps": 4, "guidance_scale": 1.0}
    image = await dit.generate(prompt="", prompt_embeds=first.prompt_embeds, seed=7, **fields)
    pipe = StableDiffusionPipeline.from_pretrained(str(diffusion_dir), local_files_only=True)  # type: ignore[no-untyped-call]
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        local = pipe(
            prompt_embeds=hidden[None],
            generator=torch.Generator().manual_seed(7),
            output_type="pil",
            **fields,
        ).images[0]
    from omnistage_worker.runners.frames import png

    assert image.image.png == png(local)
    # Together (same shape: one call) each equals its own.
    six = ("the cat sat on the mat", "a dog ran in the park", "the dog sat on the mat")
    same_len = [await _encode(encoder, p) for p in six]
    alone = [
        await dit.generate(prompt="", prompt_embeds=e.prompt_embeds, seed=3, **fields)
        for e in same_len
    ]
    together = await asyncio.gather(
        *(
            dit.generate(prompt="", prompt_embeds=e.prompt_embeds, seed=3, **fields)
            for e in same_len
        )
    )
    assert max(r.batch_size for r in together) >= 2  # the first may start alone
    from tests.worker.test_diffusion_batching import assert_same_image

    for one, both in zip(alone, together, strict=True):
        assert_same_image(one.image.png, both.image.png)
    assert together[0].image.png != together[1].image.png


async def test_embeds_refused_naming_the_field(
    start_worker: StartWorker, encoder_dir: Path, diffusion_dir: Path
) -> None:
    encoder = await start_worker(encoder_dir, "ar", "transformers")
    dit = await start_worker(diffusion_dir, "diffusion", "diffusers")
    embeds = (await _encode(encoder, "the cat sat")).prompt_embeds
    wide = pack(torch.ones(3, 32), torch.ones(3))
    padded = pack(torch.ones(3, 16), torch.tensor([1, 1, 0]))
    cases: tuple[tuple[dict[str, Any], str], ...] = (
        (
            {"prompt_embeds": wide},
            "prompt_embeds: hidden width 32 is not StableDiffusionPipeline's 16",
        ),
        ({"prompt_embeds": embeds, "prompt": "x"}, "prompt_embeds: give a prompt or prompt embeds"),
        ({"prompt_embeds": padded}, "prompt_embeds: StableDiffusionPipeline takes no mask"),
        ({"prompt_embeds": PE(shape=[1], dtype="F32")}, "prompt_embeds: shape [1] is not"),
    )
    for fields, start in cases:
        fields.setdefault("prompt", "")
        error = await rpc_error(dit.generate(**fields))
        assert error.code() == INVALID, error.details()
        assert (error.details() or "").startswith(start), error.details()
    error = await rpc_error(encoder.generate(prompt="the cat", prompt_embeds=embeds))
    assert error.code() == INVALID
    assert (error.details() or "").startswith("prompt_embeds: an AR stage takes a prompt")
    error = await rpc_error(_encode(dit, "the cat"))
    assert error.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "StableDiffusion" not in (error.details() or "") and "cannot encode" in (
        error.details() or ""
    )
    error = await rpc_error(_encode(encoder, ""))
    assert error.code() == INVALID and (error.details() or "").startswith("prompt:")


async def test_encode_is_held_while_asleep_on_demand(
    start_worker: StartWorker, encoder_dir: Path
) -> None:
    encoder = await start_worker(
        encoder_dir, "ar", "transformers", activation="ondemand", initial_state="asleep"
    )
    call = asyncio.ensure_future(_encode(encoder, "the cat sat"))

    async def held() -> bool:
        return encoder.server.worker.demand.held == 1

    await wait_for(held, within=10, what="the Encode held")
    assert not call.done()
    ack = await encoder.wake()
    assert ack.ok and ack.state == types_pb2.WORKER_STATE_ACTIVE
    response = await asyncio.wait_for(call, 30)
    assert list(response.prompt_embeds.shape) == [3, 16]


@pytest.fixture(scope="module")
def qwen_image_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny Qwen-Image split in two stages: a Qwen2 encoder and the DiT + VAE pipeline."""
    from bench.qwen_image_like import TINY, build_dit, build_encoder

    root = tmp_path_factory.mktemp("qwen-image")
    return build_encoder(TINY, root / "enc"), build_dit(TINY, root / "dit")


async def test_qwen_image_stages_take_embeds_and_mask_like_one_process(
    start_worker: StartWorker, qwen_image_dirs: tuple[Path, Path]
) -> None:
    from tests.worker.pipeline_reference import InProcessPipeline

    enc_dir, dit_dir = qwen_image_dirs
    encoder = await start_worker(enc_dir, "ar", "transformers")
    dit = await start_worker(dit_dir, "diffusion", "diffusers")  # no text encoder in it
    prompt = "a bird can fly over the tree"
    embeds = (await _encode(encoder, prompt)).prompt_embeds
    fields = {"height": 32, "width": 32, "num_inference_steps": 2}
    got = await dit.generate(prompt="", prompt_embeds=embeds, seed=11, **fields)
    reference = InProcessPipeline(enc_dir, dit_dir)
    assert reference.takes_mask
    assert got.image.png == reference.images([prompt], [11], fields)[0]
    # A padded mask reaches the pipeline (it takes one): another image, no refusal.
    hidden, _ = unpack(embeds)
    n = hidden.shape[0]
    padded = pack(torch.cat([hidden, torch.zeros(2, 16)]), torch.tensor([1] * n + [0, 0]))
    other = await dit.generate(prompt="", prompt_embeds=padded, seed=11, **fields)
    assert other.image.png and other.image.width == 32
    error = await rpc_error(dit.generate(prompt="a bird", seed=1, **fields))
    assert error.code() != grpc.StatusCode.OK  # a prompt needs the text encoder it has not
