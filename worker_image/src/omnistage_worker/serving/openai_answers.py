"""OpenAI answers, built as pure functions from Generate responses (no server, no model).

Completions and chat completions (whole or streamed chunks), with ``usage``, the runner's
``finish_reason`` and ``logprobs`` in each endpoint's shape; images; the model list.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.serving.openai_api import JSON, Parsed

_REASONS = {
    inference_service_pb2.FINISH_REASON_STOP: "stop",
    inference_service_pb2.FINISH_REASON_LENGTH: "length",
}

Logprobs = Sequence[inference_service_pb2.TokenLogprob]


def finish_reason(text: inference_service_pb2.TextOutput, max_tokens: int) -> str:
    """The runner's finish reason; for a runner that gives none, ``length`` when the token
    budget ran out, ``stop`` otherwise."""
    reason = _REASONS.get(text.finish_reason)
    if reason is not None:
        return reason
    return "length" if max_tokens and len(text.token_ids) >= max_tokens else "stop"


def usage_body(parsed: Parsed, responses: Sequence[inference_service_pb2.GenerateResponse]) -> JSON:
    """Token counts: each prompt once (``n`` choices share it), every choice's completion."""
    prompt = sum(r.usage.prompt_tokens for i, r in enumerate(responses) if i % parsed.n == 0)
    completion = sum(r.usage.completion_tokens for r in responses)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def _bytes(token: str) -> list[int]:
    return list(token.encode())


def chat_logprobs(entries: Logprobs) -> JSON:
    """Chat's ``logprobs``: ``content`` with one entry per token and its alternatives."""
    content = [
        {
            "token": e.token,
            "logprob": e.logprob,
            "bytes": _bytes(e.token),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token)} for t in e.top
            ],
        }
        for e in entries
    ]
    return {"content": content, "refusal": None}


def completion_logprobs(entries: Logprobs, offset: int = 0) -> JSON:
    """Completions' ``logprobs``: parallel lists of tokens, their log probabilities, the
    alternatives (token -> log probability) and each token's offset in the text."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{t.token: t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


def _logprobs(parsed: Parsed, entries: Logprobs, chat: bool, offset: int = 0) -> JSON | None:
    if parsed.logprobs is None:
        return None
    return chat_logprobs(entries) if chat else completion_logprobs(entries, offset)


def answer_id(parsed: Parsed, chat: bool) -> str:
    stem = parsed.request.request_id.removeprefix("req-").rsplit("-", 1)[0]
    return ("chatcmpl-" if chat else "cmpl-") + stem


def completion_body(
    parsed: Parsed,
    responses: Sequence[inference_service_pb2.GenerateResponse],
    model: str,
    chat: bool,
) -> JSON:
    """A complete (non-streamed) completion or chat completion, one choice per response."""
    choices = []
    for index, response in enumerate(responses):
        text = response.text
        choice: JSON = {
            "index": index,
            "finish_reason": finish_reason(text, parsed.max_tokens),
            "logprobs": _logprobs(parsed, text.logprobs, chat),
        }
        if chat:
            choice["message"] = {"role": "assistant", "content": text.text, "refusal": None}
        else:
            choice["text"] = text.text
        choices.append(choice)
    return {
        "id": answer_id(parsed, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": usage_body(parsed, responses),
    }


def chunk_body(
    parsed: Parsed,
    model: str,
    chat: bool,
    *,
    index: int,
    text: str,
    first: bool = False,
    logprobs: Logprobs = (),
    offset: int = 0,
) -> JSON:
    """One streamed chunk carrying ``text`` of choice ``index`` (and the log probabilities
    of its tokens; ``offset``: where the text starts in the choice's whole text)."""
    choice: JSON = {"index": index, "finish_reason": None, "logprobs": None}
    if parsed.logprobs is not None and logprobs:
        choice["logprobs"] = _logprobs(parsed, logprobs, chat, offset)
    if chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    body: JSON = {
        "id": answer_id(parsed, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    if parsed.include_usage:
        body["usage"] = None
    return body


def final_chunk_body(
    parsed: Parsed,
    model: str,
    chat: bool,
    *,
    index: int,
    response: inference_service_pb2.GenerateResponse,
    logprobs: Logprobs = (),
    offset: int = 0,
) -> JSON:
    """The last chunk of choice ``index``: no text, its finish reason (and the log
    probabilities its chunks did not carry)."""
    body = chunk_body(parsed, model, chat, index=index, text="", logprobs=logprobs, offset=offset)
    choice = body["choices"][0]
    choice["finish_reason"] = finish_reason(response.text, parsed.max_tokens)
    if chat:
        choice["delta"] = {}
    return body


def usage_chunk_body(
    parsed: Parsed,
    model: str,
    chat: bool,
    responses: Sequence[inference_service_pb2.GenerateResponse],
) -> JSON:
    """``stream_options.include_usage``: the chunk after the last, no choices, the usage."""
    return {
        "id": answer_id(parsed, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [],
        "usage": usage_body(parsed, responses),
    }


def image_body(responses: Sequence[inference_service_pb2.GenerateResponse], usage: JSON) -> JSON:
    """An images response: one base64 PNG per response, and ``usage`` (:mod:`.image_usage`)."""
    return {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(r.image.png).decode("ascii")} for r in responses],
        "usage": usage,
    }


def models_body(model: str, created: int) -> JSON:
    """``/v1/models``: the one model this stage serves."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "omnistage"}],
    }
