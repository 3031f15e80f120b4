"""The OpenAI request parsing and answer shapes, as pure functions."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from omnistage.worker.v1 import inference_service_pb2 as pb
from omnistage_worker.serving import openai_answers as A
from omnistage_worker.serving import openai_api as O


def test_n_and_prompt_lists_make_one_request_per_choice() -> None:
    parsed = O.parse_completion(
        {"prompt": ["a b", "c"], "n": 2, "seed": 5, "temperature": 0.5, "stop": "x"}, "m"
    )
    assert [(r.prompt, r.seed) for r in parsed.requests] == [
        ("a b", 5), ("a b", 6), ("c", 5), ("c", 6),
    ]  # fmt: skip
    assert len({r.request_id for r in parsed.requests}) == 4
    assert all(r.temperature == 0.5 and list(r.stop) == ["x"] for r in parsed.requests)
    assert not parsed.request.HasField("top_p") and not parsed.request.HasField("top_logprobs")
    greedy = O.parse_completion({"prompt": "a"}, "m").request
    assert not greedy.HasField("temperature") and not greedy.do_sample


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "a", "stream": True, "stream_options": {"x": 1}}, "stream_options"),
        ({"prompt": "a", "n": 0}, "n"),
        ({"prompt": "a", "n": 17}, "n"),
        ({"prompt": "a", "temperature": 2.5}, "temperature"),
        ({"prompt": "a", "top_p": 0}, "top_p"),
        ({"prompt": "a", "stop": ""}, "stop"),
        ({"prompt": "a", "seed": "1"}, "seed"),
        ({"prompt": "a", "user": 3}, "user"),
        ({"prompt": ["a", 3]}, "prompt"),
        ({"prompt": "a", "best_of": 2, "n": 1}, "best_of"),
        ({"prompt": "a", "frequency_penalty": 1}, "frequency_penalty"),
    ],
)
def test_completion_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(O.BadRequest) as info:
        O.parse_completion(body, "m")
    assert info.value.param == param and info.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"store": True}, "store"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content[0]"),
    ],
)  # fmt: skip
def test_chat_refusals_name_the_field(body: dict[str, Any], param: str) -> None:
    with pytest.raises(O.BadRequest) as info:
        O.parse_chat({"messages": [{"role": "user", "content": "hi"}], **body}, "m")
    assert info.value.param == param


def test_chat_accepts_defaults_of_what_it_cannot_do() -> None:
    parsed = O.parse_chat(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "presence_penalty": 0,
            "logprobs": True,
            "max_completion_tokens": 3,
        },
        "m",
    )
    assert parsed.logprobs == 0 and parsed.max_tokens == 3
    assert parsed.param("max_new_tokens") == "max_completion_tokens"
    assert parsed.param("prompt") == "messages"


def test_a_runner_refusal_names_the_clients_field() -> None:
    parsed = O.parse_image({"prompt": "x", "size": "64x72"}, "m")
    status, body = O.refusal_status(
        grpc.StatusCode.INVALID_ARGUMENT, "height: 72 is not a multiple of 16", parsed.param
    )
    assert status == 400 and body["error"]["param"] == "size"
    status, body = O.refusal_status(grpc.StatusCode.UNAVAILABLE, "worker shutting down: ...")
    assert status == 503 and body["error"]["code"] == "worker_shutting_down"


def _response(prompt: int, ids: list[int], reason: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(
        text=pb.TextOutput(token_ids=ids, text="t", finish_reason=reason),  # type: ignore[arg-type]
        usage=pb.Usage(prompt_tokens=prompt, completion_tokens=len(ids)),
    )


def test_usage_counts_each_prompt_once_and_every_choice() -> None:
    parsed = O.parse_completion({"prompt": ["a", "b c"], "n": 2}, "m")
    responses = [_response(1, [1]), _response(1, [1, 2]), _response(2, [3]), _response(2, [])]
    assert A.usage_body(parsed, responses) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


def test_finish_reason_is_the_runners_else_from_the_budget() -> None:
    stop = pb.TextOutput(token_ids=[1, 2], finish_reason=pb.FINISH_REASON_STOP)
    assert A.finish_reason(stop, 2) == "stop"  # a stop string ended it on the last token
    assert A.finish_reason(pb.TextOutput(token_ids=[1, 2]), 2) == "length"
    assert A.finish_reason(pb.TextOutput(token_ids=[1]), 2) == "stop"


def test_logprob_shapes() -> None:
    entries = [
        pb.TokenLogprob(token="ab", logprob=-0.5, top=[pb.TopLogprob(token="ab", logprob=-0.5)]),
        pb.TokenLogprob(token="c", logprob=-1.0),
    ]
    legacy = A.completion_logprobs(entries)
    assert legacy["tokens"] == ["ab", "c"] and legacy["text_offset"] == [0, 2]
    assert legacy["top_logprobs"] == [{"ab": -0.5}, {}]
    chat = A.chat_logprobs(entries)["content"]
    assert chat[0]["bytes"] == [97, 98] and chat[0]["top_logprobs"][0]["token"] == "ab"
