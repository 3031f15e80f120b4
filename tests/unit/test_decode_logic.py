"""The pure parts of AR batching: per-request token choice (as transformers' warpers choose)
and one request's text (stop sequences, what may be streamed)."""

from __future__ import annotations

import pytest
import torch

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest
from omnistage_worker.runners.sampling import Sampling, resolve_sampling, validate_sampling
from omnistage_worker.runners.text_output import WINDOW, TextOutput
from omnistage_worker.runners.token_choice import choose, new_generator, read_step, warp_rows

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


def test_warp_rows_matches_transformers_warpers_row_by_row() -> None:
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    torch.manual_seed(0)
    logits = torch.randn(4, 100)
    samplings = [
        Sampling(greedy=False, temperature=0.8, top_k=30, top_p=0.7),
        Sampling(greedy=False, temperature=1.0, top_k=0, top_p=1.0),  # nothing cut
        Sampling(greedy=False, temperature=1.3, top_k=5, top_p=1.0),
        Sampling(greedy=False, temperature=1.0, top_k=0, top_p=0.5),
    ]
    warped = warp_rows(logits, samplings)
    for row, sampling in enumerate(samplings):
        expected = logits[row : row + 1].clone()
        warpers: list[object] = []
        if sampling.temperature != 1.0:
            warpers.append(TemperatureLogitsWarper(sampling.temperature))
        if sampling.top_k:
            warpers.append(TopKLogitsWarper(sampling.top_k))
        if sampling.top_p < 1.0:
            warpers.append(TopPLogitsWarper(sampling.top_p))
        for warper in warpers:
            expected = warper(torch.zeros(1, 1, dtype=torch.long), expected)  # type: ignore[operator]
        assert torch.equal(warped[row], expected[0]), row
    assert torch.isinf(warped[2]).sum() == 95  # top-k 5 keeps 5


def test_each_row_draws_from_its_own_seed() -> None:
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    hot = Sampling(greedy=False, temperature=1.0, top_k=0)
    cold = Sampling(greedy=False, temperature=0.5, top_k=10, top_p=0.8, seed=9)
    alone_gen = new_generator(7)
    alone = [int(choose(logits[1:2], [hot], [alone_gen])[0]) for _ in range(20)]
    batch_gen = new_generator(7)
    other = new_generator(9)
    batch = [
        choose(logits, [Sampling(greedy=True), hot, cold], [None, batch_gen, other]).tolist()
        for _ in range(20)
    ]
    assert all(b[0] == int(logits[0].argmax()) for b in batch)
    assert [b[1] for b in batch] == alone  # the same seed draws the same, whatever the others
    assert len(set(alone)) > 1  # it does sample


def test_draws_follow_the_distribution() -> None:
    """Inverse-CDF draws land on each token about as often as its probability says, and
    never on a token cut away."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    logits = probs.log()[None, :].expand(2, -1).contiguous()
    sampling = Sampling(greedy=False, temperature=1.0, top_k=0)
    generator, other = new_generator(3), new_generator(4)
    counts = torch.zeros(5)
    draws = 4000
    for _ in range(draws // 2):
        tokens = choose(logits, [sampling, sampling], [generator, other])
        counts.index_add_(0, tokens, torch.ones(2))
    assert counts[4] == 0
    assert torch.allclose(counts / draws, probs, atol=0.03), counts / draws


def test_read_step_gives_raw_log_softmax_with_the_top_alternatives() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0], [1.0, 1.0, 1.0], [3.0, 0.0, 0.0]])
    tokens = torch.tensor([2, 0, 0])
    out = read_step(tokens, logits, [2, None, 0], lambda t: f"t{t}")
    (t0, first), (t1, second), (t2, third) = out
    assert (t0, t1, t2) == (2, 0, 0)
    assert first is not None and third is not None
    assert second is None
    expected = torch.log_softmax(logits[0], dim=-1)
    assert first.token_id == 2 and first.token == "t2"
    assert first.logprob == pytest.approx(float(expected[2]))
    assert [t.token_id for t in first.top] == [1, 2]
    assert first.top[0].logprob == pytest.approx(float(expected[1]))
    assert len(third.top) == 0
    assert read_step(tokens, logits, [None, None, None], str) == [(2, None), (0, None), (0, None)]


def test_joins_are_at_once_while_cheap_else_gathered() -> None:
    from omnistage_worker.runners.decode_policy import JOIN_EVERY, JOIN_PADDING, join_now

    assert not join_now([], 3, 10, 100)
    assert join_now([500], 0, 10, 0)  # nothing runs: at once
    assert join_now([17, 17], 15, 49, 0)  # 15 rows padded by 16: 240 tokens, cheap
    big = JOIN_PADDING // 16 + 1  # rows that 16 tokens of padding each make too many
    assert not join_now([17], big, 10, 1)  # gathered ...
    assert join_now([17], big, 10, JOIN_EVERY)  # ... until due
    assert join_now([17, 17], big, 2, 1)  # or they fill the batch
    assert not join_now([2000], 1, 10, 0)  # a long prompt pads even one row too much


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


def test_streaming_decodes_a_window_per_token_not_the_whole_output() -> None:
    """A long stream costs the same per token: each token decodes at most ``WINDOW`` ids, and
    the streamed text is still the whole output's text."""
    sizes: list[int] = []

    def decode(ids: list[int]) -> str:
        sizes.append(len(ids))
        return words(ids)

    text = TextOutput(decode, ["w9999"], streamed=True)
    ids = [1 + i % 50 for i in range(300)]
    streamed = "".join(text.add(i) for i in ids) + text.finish()
    assert streamed == text.text == words(ids)
    assert max(sizes[:-1]) <= WINDOW  # the last call: the final text, decoded whole
    assert sum(sizes) < 2 * WINDOW * len(ids)


def _pieces(ids: list[int]) -> str:
    """A SentencePiece-like decoder over byte pieces: id 0 is a space marker word, odd ids
    are the two halves of "é" (UTF-8 split over two tokens), the sequence's leading space is
    stripped."""
    raw = b"".join(b" w" if i == 0 else (b"\xc3" if i % 2 else b"\xa9") for i in ids)
    return raw.decode("utf-8", errors="replace").removeprefix(" ")


def test_windowed_streaming_keeps_spaces_and_split_characters() -> None:
    ids = [0, 1, 2, 0, 0, 1, 2, 1, 2] * 12
    text = TextOutput(_pieces, [], streamed=True)
    chunks = [text.add(i) for i in ids]
    assert not any("\ufffd" in c for c in chunks)
    assert "".join(chunks) + text.finish() == _pieces(ids) == text.text
