"""``usage`` of an images answer: the prompt's tokens by the pipeline's tokenizer, no output
tokens, the images made and the denoising steps (the request's, else the pipeline's default)."""

from __future__ import annotations

from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.serving.image_usage import default_steps, image_usage, prompt_tokens


class Tokenizer:
    model_max_length = 4

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": list(range(len(text.split()) + 2))}  # with begin and end


class Pipeline:
    tokenizer = Tokenizer()

    def __call__(self, prompt: str, num_inference_steps: int = 28) -> Any:
        return None


class Runner:
    pipeline = Pipeline()


def test_usage_counts_the_prompt_and_says_images_and_steps() -> None:
    request = inference_service_pb2.GenerateRequest(prompt="a cat", num_inference_steps=3)
    usage = image_usage(Runner(), request, images=2)
    assert usage == {
        "input_tokens": 4,
        "input_tokens_details": {"text_tokens": 4, "image_tokens": 0},
        "output_tokens": 0,
        "output_tokens_details": {"text_tokens": 0, "image_tokens": 0},
        "total_tokens": 4,
        "images": 2,
        "steps": 3,
    }
    unset = image_usage(Runner(), inference_service_pb2.GenerateRequest(prompt="a"), images=1)
    assert unset["steps"] == 28 and unset["input_tokens"] == 3


def test_prompt_is_cut_where_the_pipeline_cuts_and_missing_parts_count_zero() -> None:
    assert prompt_tokens(Pipeline(), "one two three four five") == 4
    assert prompt_tokens(None, "x") == 0
    assert default_steps(None) == 0
    assert default_steps(lambda prompt: None) == 0
