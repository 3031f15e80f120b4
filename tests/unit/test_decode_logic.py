"""The pure parts of AR batching: per-request token choice (as transformers' warpers choose)
and one request's text (stop sequences, what may be streamed)."""

from __future__ import annotations

import pytest
import torch

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest
from omnistage_worker.runners.sampling import (
    Sampling,
    choose,
    new_generator,
    resolve_sampling,
    token_logprobs,
    validate_sampling,
    warp,
)
from omnistage_worker.runners.text_output import TextOutput

Request = inference_service_pb2.GenerateRequest


class Defaults:
    temperature = 0.7
    top_p = 0.9
    top_k = 20


def test_resolve_sampling_follows_the_interface() -> None:
    assert resolve_sampling(Request(), Defaults()).greedy  # temperature unset, no do_sample
    legacy = resolve_sampling(Request(do_sample=True, seed=5), Defaults())
    assert (legacy.greedy, legacy.temperature, legacy.top_p, legacy.top_k, legacy.seed) == (
        False, 0.7, 0.9, 20, 5,
    )  # fmt: skip
    assert resolve_sampling(Request(temperature=0, do_sample=True), Defaults()).greedy
    hot = resolve_sampling(Request(temperature=1.5, top_p=0.5, top_logprobs=2), Defaults())
    assert (hot.greedy, hot.temperature, hot.top_p, hot.top_logprobs) == (False, 1.5, 0.5, 2)
    assert resolve_sampling(Request(temperature=1.0), object()).top_k == 50  # library default


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_logprobs": 21}, "top_logprobs"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"stop": ["a", ""]}, "stop[1]"),
    ],
)
def test_bad_sampling_fields_are_refused_by_name(fields: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        validate_sampling(Request(**fields))  # type: ignore[arg-type]
    assert info.value.field == field


def test_warp_matches_transformers_warpers() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(1, 100)
    sampling = Sampling(greedy=False, temperature=0.8, top_k=30, top_p=0.7)
    expected = logits.clone()
    for warper in (TemperatureLogitsWarper(0.8), TopKLogitsWarper(30), TopPLogitsWarper(0.7)):
        expected = warper(torch.zeros(1, 1, dtype=torch.long), expected)
    assert torch.equal(warp(logits[0], sampling), expected[0])


def test_each_row_draws_from_its_own_seed() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    hot = Sampling(greedy=False, temperature=1.0, top_k=0)
    cpu = torch.device("cpu")
    alone = choose(logits[1:2], [hot], [new_generator(cpu, 7)])
    batch = choose(
        logits,
        [Sampling(greedy=True), hot, hot],
        [None, new_generator(cpu, 7), new_generator(cpu, 9)],
    )
    assert batch[0] == int(logits[0].argmax())
    assert batch[1] == alone[0]  # the same seed draws the same, whatever the other rows


def test_token_logprobs_are_raw_log_softmax_with_the_top_alternatives() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 1.0]])
    out = token_logprobs(logits, [2, 0], [2, None], lambda t: f"t{t}")
    first, second = out
    assert first is not None
    assert second is None
    expected = torch.log_softmax(logits[0], dim=-1)
    assert first.token_id == 2 and first.token == "t2"
    assert first.logprob == pytest.approx(float(expected[2]))
    assert [t.token_id for t in first.top] == [1, 2]
    assert first.top[0].logprob == pytest.approx(float(expected[1]))


def stopped(text: TextOutput) -> bool:
    return text.stopped


def words(ids: list[int]) -> str:
    return " ".join(f"w{i}" for i in ids)


def test_stop_cuts_text_and_holds_back_what_a_stop_could_take() -> None:
    text = TextOutput(words, ["w3 w4"], streamed=True)
    sent = [text.add(1), text.add(2), text.add(3)]
    assert sent == ["w1", " w2", " "]  # "w3" could start the stop: held back
    assert not stopped(text)
    assert text.add(4) == ""  # the stop completed: the text ends before it
    assert stopped(text) and text.text == "w1 w2 "
    assert text.finish() == ""
    assert text.ids == [1, 2, 3, 4]


def test_held_back_text_is_sent_when_the_stop_does_not_come() -> None:
    text = TextOutput(words, ["w3 w4"], streamed=True)
    streamed = text.add(3) + text.add(5) + text.finish()
    assert streamed == "w3 w5" == text.text and not text.stopped


def test_unstreamed_text_without_stops_is_decoded_once_at_the_end() -> None:
    calls: list[list[int]] = []

    def decode(ids: list[int]) -> str:
        calls.append(list(ids))
        return words(ids)

    text = TextOutput(decode, [], streamed=False)
    assert [text.add(i) for i in (1, 2, 3)] == ["", "", ""]
    assert text.finish() == "" and text.text == "w1 w2 w3"
    assert calls == [[1, 2, 3]]
