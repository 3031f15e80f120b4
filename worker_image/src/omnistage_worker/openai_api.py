"""The OpenAI request and response shapes, as pure functions (no server, no model).

Requests become a :class:`GenerateRequest`; outputs become OpenAI JSON objects; refusals
become the OpenAI error shape with an HTTP status. :mod:`.openai_http` serves them.
"""

from __future__ import annotations

import base64
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from omnistage.worker.v1 import inference_service_pb2

JSON = dict[str, Any]
_SIZE = re.compile(r"^(\d+)x(\d+)$")


class BadRequest(ValueError):
    """A request the API refuses before it reaches the model; ``param`` names the field."""

    def __init__(self, param: str | None, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status


@dataclass(frozen=True)
class Parsed:
    """A parsed OpenAI request: the Generate request and how to answer it."""

    request: inference_service_pb2.GenerateRequest
    stream: bool
    max_tokens: int


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> JSON:
    """The OpenAI error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# gRPC status of a refusal -> HTTP status, OpenAI error type, error code.
_REFUSALS: Mapping[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_value"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "stage_not_active", "stage_not_active"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable", "hold_timeout"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error", "hold_queue_full"),
}


def refusal_status(code: grpc.StatusCode, message: str) -> tuple[int, JSON]:
    """HTTP status and OpenAI error body for a worker refusal."""
    status, kind, error_code = _REFUSALS.get(code, (500, "server_error", "internal_error"))
    if code == grpc.StatusCode.UNAVAILABLE and "loading" in message:
        error_code = "model_loading"
    param = message.split(":", 1)[0] if code == grpc.StatusCode.INVALID_ARGUMENT else None
    return status, error_body(message, kind, param, error_code)


def _obj(body: Any) -> JSON:
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    return body


def _int(body: JSON, key: str, default: int, low: int = 0) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(key, f"{key} must be an integer")
    if value < low:
        raise BadRequest(key, f"{key} must be at least {low}")
    return value


def _sampling(body: JSON) -> tuple[bool, int]:
    """Whether to sample (temperature > 0) and the seed."""
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float)
    ):
        raise BadRequest("temperature", "temperature must be a number")
    if temperature is not None and temperature < 0:
        raise BadRequest("temperature", "temperature must be at least 0")
    seed = _int(body, "seed", 0)
    return bool(temperature), seed


def check_model(body: JSON, served: str) -> None:
    """404 when the request names another model (a missing name means this one)."""
    model = body.get("model")
    if model not in (None, "", served):
        raise BadRequest(
            "model", f"the model {model!r} does not exist here (this stage serves {served!r})", 404
        )


def _common(body: JSON, prompt: str) -> Parsed:
    max_tokens = _int(body, "max_tokens", 0, low=1) if body.get("max_tokens") is not None else 0
    if not max_tokens and body.get("max_completion_tokens") is not None:
        max_tokens = _int(body, "max_completion_tokens", 0, low=1)
    if _int(body, "n", 1, low=1) != 1:
        raise BadRequest("n", "only n=1 is supported")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", "stream must be true or false")
    do_sample, seed = _sampling(body)
    request = inference_service_pb2.GenerateRequest(
        request_id=f"req-{uuid.uuid4().hex}",
        prompt=prompt,
        max_new_tokens=max_tokens,
        do_sample=do_sample,
        seed=seed,
    )
    return Parsed(request, stream, max_tokens)


def parse_completion(raw: Any, served: str) -> Parsed:
    """A ``/v1/completions`` body (``prompt``: a string or a list of one string)."""
    body = _obj(raw)
    check_model(body, served)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt", "prompt must be a non-empty string (or a list of one)")
    return _common(body, prompt)


ChatTemplate = Callable[[list[JSON]], str] | None


def plain_chat_prompt(messages: Sequence[JSON]) -> str:
    """A chat rendered without a model template: ``role: content`` lines, then ``assistant:``."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def parse_chat(raw: Any, served: str, template: ChatTemplate = None) -> Parsed:
    """A ``/v1/chat/completions`` body; ``template`` renders the messages (the tokenizer's)."""
    body = _obj(raw)
    check_model(body, served)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list")
    clean: list[JSON] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}]", "each message needs a role and a content")
        content = message.get("content")
        if isinstance(content, list):  # content parts: the text ones, joined
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content", "content must be a string")
        clean.append({"role": message["role"], "content": content})
    prompt = template(clean) if template is not None else plain_chat_prompt(clean)
    return _common(body, prompt)


def parse_image(raw: Any, served: str) -> Parsed:
    """A ``/v1/images/generations`` body (``b64_json`` only; ``size`` as ``WxH``)."""
    body = _obj(raw)
    check_model(body, served)
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt", "prompt must be a non-empty string")
    if _int(body, "n", 1, low=1) != 1:
        raise BadRequest("n", "only n=1 is supported")
    if body.get("response_format", "b64_json") not in (None, "b64_json"):
        raise BadRequest("response_format", "only b64_json is supported")
    width = height = 0
    size = body.get("size")
    if size not in (None, "", "auto"):
        match = _SIZE.match(str(size))
        if match is None:
            raise BadRequest("size", "size must look like 512x512")
        width, height = int(match.group(1)), int(match.group(2))
    guidance = body.get("guidance_scale", 0.0)
    if isinstance(guidance, bool) or not isinstance(guidance, int | float):
        raise BadRequest("guidance_scale", "guidance_scale must be a number")
    request = inference_service_pb2.GenerateRequest(
        request_id=f"img-{uuid.uuid4().hex}",
        prompt=prompt,
        seed=_int(body, "seed", 0),
        num_inference_steps=_int(body, "num_inference_steps", 0),
        width=width,
        height=height,
        guidance_scale=float(guidance),
    )
    return Parsed(request, False, 0)


def finish_reason(tokens: int, max_tokens: int) -> str:
    """``length`` when the token budget ran out, ``stop`` otherwise."""
    return "length" if max_tokens and tokens >= max_tokens else "stop"


def completion_body(
    parsed: Parsed, response: inference_service_pb2.GenerateResponse, model: str, chat: bool
) -> JSON:
    """A complete (non-streamed) completion or chat completion."""
    text = response.text
    reason = finish_reason(len(text.token_ids), parsed.max_tokens)
    choice: JSON = {"index": 0, "finish_reason": reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text.text}
    else:
        choice["text"] = text.text
    return {
        "id": _id(parsed, chat),
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def _id(parsed: Parsed, chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + parsed.request.request_id.removeprefix("req-")


def chunk_body(parsed: Parsed, model: str, chat: bool, text: str, first: bool = False) -> JSON:
    """One streamed chunk carrying ``text``."""
    choice: JSON = {"index": 0, "finish_reason": None, "logprobs": None}
    if chat:
        choice["delta"] = {"role": "assistant", "content": text} if first else {"content": text}
    else:
        choice["text"] = text
    return {
        "id": _id(parsed, chat),
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }


def final_chunk_body(parsed: Parsed, model: str, chat: bool, tokens: int) -> JSON:
    """The last streamed chunk: no text, the finish reason."""
    body = chunk_body(parsed, model, chat, "")
    choice = body["choices"][0]
    choice["finish_reason"] = finish_reason(tokens, parsed.max_tokens)
    if chat:
        choice["delta"] = {}
    return body


def image_body(response: inference_service_pb2.GenerateResponse) -> JSON:
    """An images response with one base64 PNG."""
    return {
        "created": int(time.time()),
        "data": [{"b64_json": base64.b64encode(response.image.png).decode("ascii")}],
    }


def models_body(model: str, created: int) -> JSON:
    """``/v1/models``: the one model this stage serves."""
    return {
        "object": "list",
        "data": [{"id": model, "object": "model", "created": created, "owned_by": "omnistage"}],
    }
