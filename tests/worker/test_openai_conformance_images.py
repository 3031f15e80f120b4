"""The ``openai`` client's ``images.generate`` against the tiny diffusion stage and the router
in front of it (the conformance suite's image part; ``test_openai_conformance.py`` has the
text part)."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.worker import openai_targets
from tests.worker.openai_targets import (
    IMAGES,
    Stages,
    base,
    client,
)

# The suite's fixtures, found by pytest under their own names: _close_clients, stages.
_close_clients = openai_targets.close_clients
_stages_fixture = openai_targets.stages_fixture


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
