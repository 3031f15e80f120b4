"""The vLLM front's field check (pure): a field vLLM's request model lacks is named."""

from __future__ import annotations

from omnistage_worker.serving.vllm_fields import refusal, unknown_field

ACCEPTED = frozenset({"model", "prompt", "max_tokens", "top_k"})


def test_the_first_unknown_top_level_field_is_named() -> None:
    assert unknown_field(b'{"model": "m", "prompt": "x", "best_of": 2, "zz": 1}', ACCEPTED) == (
        "best_of"
    )
    assert unknown_field(b'{"model": "m", "top_k": 3}', ACCEPTED) is None


def test_a_body_that_is_not_a_json_object_is_left_to_vllm() -> None:
    assert unknown_field(b"not json", ACCEPTED) is None
    assert unknown_field(b"[1, 2]", ACCEPTED) is None


def test_the_refusal_names_the_field_in_openais_shape() -> None:
    body = refusal("best_of", "/v1/completions")
    assert body["error"]["param"] == "best_of"
    assert body["error"]["type"] == "invalid_request_error"
    assert "best_of" in body["error"]["message"]
