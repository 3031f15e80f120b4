"""OpenAI requests, parsed as pure functions (no server, no model).

A request becomes a :class:`Parsed`: the Generate requests to run (``n`` per prompt, seeds
``seed``, ``seed + 1``, ...) and how to answer them. Every field the OpenAI API defines is
either honoured or refused with :class:`BadRequest` naming it in ``param``; a field the API
does not define is refused too (never ignored). :mod:`.openai_answers` builds the answers,
:mod:`.openai_http` serves them.
"""

from __future__ import annotations

import math
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from omnistage.worker.v1 import inference_service_pb2

JSON = dict[str, Any]
_SIZE = re.compile(r"^(\d+)x(\d+)$")

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_N = 16


class BadRequest(ValueError):
    """A request the API refuses before it reaches the model; ``param`` names the field."""

    def __init__(
        self, param: str | None, message: str, status: int = 400, code: str = "invalid_value"
    ) -> None:
        super().__init__(message)
        self.param = param
        self.message = message
        self.status = status
        self.code = code


@dataclass(frozen=True)
class Parsed:
    """A parsed OpenAI request: the Generate requests and how to answer them.

    ``requests`` holds ``n`` requests per prompt, in choice order (choice ``i`` answers
    ``requests[i]``). ``logprobs`` is None when not asked, else the number of alternatives.
    ``params`` maps a GenerateRequest field to the OpenAI parameter the client set it with,
    so a refusal by the runner names the client's field.
    """

    requests: tuple[inference_service_pb2.GenerateRequest, ...]
    stream: bool = False
    include_usage: bool = False
    max_tokens: int = 0
    logprobs: int | None = None
    n: int = 1
    params: Mapping[str, str] = field(default_factory=dict)
    user: str | None = None  # the client's end-user id (logged, not used)

    @property
    def request(self) -> inference_service_pb2.GenerateRequest:
        """The first request (its id names the answer)."""
        return self.requests[0]

    def param(self, request_field: str) -> str:
        """The OpenAI parameter behind a GenerateRequest field."""
        return self.params.get(request_field, request_field)


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


def refusal_status(
    code: grpc.StatusCode, message: str, params: Callable[[str], str] = str
) -> tuple[int, JSON]:
    """HTTP status and OpenAI error body for a worker refusal (``params`` renames fields)."""
    status, kind, error_code = _REFUSALS.get(code, (500, "server_error", "internal_error"))
    if code == grpc.StatusCode.UNAVAILABLE and "loading" in message:
        error_code = "model_loading"
    if code == grpc.StatusCode.UNAVAILABLE and "shutting down" in message:
        error_code = "worker_shutting_down"
    param = None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        param = params(message.split(":", 1)[0])
    return status, error_body(message, kind, param, error_code)


# -- field readers ------------------------------------------------------------------------


def _obj(body: Any) -> JSON:
    if not isinstance(body, dict):
        raise BadRequest(None, "the request body must be a JSON object")
    return body


def _int(body: JSON, key: str, default: int, low: int = 0, high: int | None = None) -> int:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(key, f"{key} must be an integer")
    if value < low:
        raise BadRequest(key, f"{key} must be at least {low}")
    if high is not None and value > high:
        raise BadRequest(key, f"{key} must be at most {high}")
    return value


def _number(body: JSON, key: str, low: float, high: float) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise BadRequest(key, f"{key} must be a number")
    if not low <= value <= high:
        raise BadRequest(key, f"{key} must be between {low:g} and {high:g}")
    return float(value)


def _bool(body: JSON, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadRequest(key, f"{key} must be true or false")
    return value


def _stop(body: JSON) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise BadRequest("stop", "stop must be a non-empty string or a list of them")
    if len(stops) > MAX_STOP:
        raise BadRequest("stop", f"stop holds at most {MAX_STOP} sequences, not {len(stops)}")
    return stops


# A field the stage cannot honour is accepted only at its default value (else refused).
_DEFAULTS: Mapping[str, Callable[[Any], bool]] = {
    "presence_penalty": lambda v: v in (None, 0),
    "frequency_penalty": lambda v: v in (None, 0),
    "logit_bias": lambda v: v in (None, {}),
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "parallel_tool_calls": lambda v: v is None,
    "response_format": lambda v: v is None or v == {"type": "text"},
    "audio": lambda v: v is None,
    "modalities": lambda v: v in (None, ["text"]),
    "prediction": lambda v: v is None,
    "suffix": lambda v: v in (None, ""),
    "echo": lambda v: v in (None, False),
    "store": lambda v: v in (None, False),
    "metadata": lambda v: v in (None, {}),
    "service_tier": lambda v: v in (None, "auto", "default"),
    "reasoning_effort": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "quality": lambda v: v in (None, "auto", "standard"),
    "style": lambda v: v is None,
}

_COMMON = {"model", "user", "n", "seed"}
_TEXT = _COMMON | {"max_tokens", "temperature", "top_p", "stream", "stream_options", "stop"}
COMPLETION_FIELDS = _TEXT | {
    "prompt", "logprobs", "best_of", "presence_penalty", "frequency_penalty", "logit_bias",
    "suffix", "echo",
}  # fmt: skip
CHAT_FIELDS = _TEXT | {
    "messages", "max_completion_tokens", "logprobs", "top_logprobs", "presence_penalty",
    "frequency_penalty", "logit_bias", "tools", "tool_choice", "functions", "function_call",
    "parallel_tool_calls", "response_format", "audio", "modalities", "prediction", "store",
    "metadata", "service_tier", "reasoning_effort", "web_search_options",
}  # fmt: skip
IMAGE_FIELDS = _COMMON | {
    "prompt", "size", "response_format", "quality", "style", "num_inference_steps",
    "guidance_scale",
}  # fmt: skip


def check_fields(body: JSON, known: set[str], own: frozenset[str] = frozenset()) -> None:
    """Refuse a field this endpoint does not define, or one set to what the stage cannot do
    (``own``: fields the endpoint checks itself)."""
    for key in body:
        if key not in known:
            raise BadRequest(key, f"unknown field {key!r}: this stage does not support it")
        honoured = None if key in own else _DEFAULTS.get(key)
        if honoured is not None and not honoured(body[key]):
            raise BadRequest(
                key, f"{key}={body[key]!r} is not supported by this stage (leave it unset)"
            )


def check_model(body: JSON, served: str) -> None:
    """404 when the request names another model (a missing name means this one)."""
    model = body.get("model")
    if model not in (None, "", served):
        raise BadRequest(
            "model",
            f"the model {model!r} does not exist here (this stage serves {served!r})",
            404,
            "model_not_found",
        )


def _user(body: JSON) -> str | None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise BadRequest("user", "user must be a string")
    return user


# -- text ---------------------------------------------------------------------------------


def _text(
    body: JSON, prompts: Sequence[str], logprobs: int | None, tokens_key: str = "max_tokens"
) -> Parsed:
    """The Generate requests shared by completions and chat."""
    max_tokens = _int(body, tokens_key, 0, low=1)
    n = _int(body, "n", 1, low=1, high=MAX_N)
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None and not stream:
        raise BadRequest("stream_options", "stream_options needs stream: true")
    include_usage = False
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise BadRequest("stream_options", "stream_options holds include_usage only")
        include_usage = _bool(options, "include_usage")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        raise BadRequest("top_p", "top_p must be more than 0")
    seed = _int(body, "seed", 0, low=-(2**63))
    stops = _stop(body)
    user = _user(body)
    stem = uuid.uuid4().hex
    requests = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            request = inference_service_pb2.GenerateRequest(
                request_id=f"req-{stem}-{p * n + i}",
                prompt=prompt,
                max_new_tokens=max_tokens,
                seed=seed + i,
                stop=stops,
            )
            if temperature is not None:
                request.temperature = temperature
            if top_p is not None:
                request.top_p = top_p
            if logprobs is not None:
                request.top_logprobs = logprobs
            requests.append(request)
    params = {"max_new_tokens": tokens_key, "top_logprobs": "logprobs", "prompt": "prompt"}
    return Parsed(tuple(requests), stream, include_usage, max_tokens, logprobs, n, params, user)


def parse_completion(raw: Any, served: str) -> Parsed:
    """A ``/v1/completions`` body (``prompt``: a string or a list of strings)."""
    body = _obj(raw)
    check_model(body, served)
    check_fields(body, COMPLETION_FIELDS)
    prompt = body.get("prompt")
    given: list[Any] = prompt if isinstance(prompt, list) else [prompt]
    prompts = [p for p in given if isinstance(p, str) and p]
    if not prompts or len(prompts) != len(given):
        raise BadRequest("prompt", "prompt must be a non-empty string or a list of them")
    n = _int(body, "n", 1, low=1, high=MAX_N)
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise BadRequest("best_of", "best_of other than n is not supported by this stage")
    logprobs = None
    if body.get("logprobs") is not None:
        logprobs = _int(body, "logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
    return _text(body, prompts, logprobs)


ChatTemplate = Callable[[list[JSON]], str] | None


def plain_chat_prompt(messages: Sequence[JSON]) -> str:
    """A chat rendered without a model template: ``role: content`` lines, then ``assistant:``."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join([*lines, "assistant:"])


def parse_chat(raw: Any, served: str, template: ChatTemplate = None) -> Parsed:
    """A ``/v1/chat/completions`` body; ``template`` renders the messages (the tokenizer's)."""
    body = _obj(raw)
    check_model(body, served)
    check_fields(body, CHAT_FIELDS)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "messages must be a non-empty list")
    clean: list[JSON] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(f"messages[{i}]", "each message needs a role and a content")
        content = message.get("content")
        if isinstance(content, list):
            content = _text_parts(content, i)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content", "content must be a string")
        clean.append({"role": message["role"], "content": content})
    prompt = template(clean) if template is not None else plain_chat_prompt(clean)
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0, low=0, high=MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise BadRequest("top_logprobs", "top_logprobs needs logprobs: true")
    key = "max_tokens" if body.get("max_tokens") is not None else "max_completion_tokens"
    parsed = _text(body, [prompt], logprobs, key)
    return Parsed(**{**parsed.__dict__, "params": {**parsed.params, "prompt": "messages"}})


def _text_parts(parts: list[Any], i: int) -> str:
    """Content parts: text only (an image or audio part is refused)."""
    texts = []
    for j, part in enumerate(parts):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise BadRequest(f"messages[{i}].content[{j}]", "only text content parts are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise BadRequest(f"messages[{i}].content[{j}].text", "text must be a string")
        texts.append(text)
    return "".join(texts)


# -- images -------------------------------------------------------------------------------


def parse_image(raw: Any, served: str) -> Parsed:
    """A ``/v1/images/generations`` body (``b64_json`` only; ``size`` as ``WxH``)."""
    body = _obj(raw)
    check_model(body, served)
    check_fields(body, IMAGE_FIELDS, own=frozenset({"response_format"}))
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("prompt", "prompt must be a non-empty string")
    n = _int(body, "n", 1, low=1, high=MAX_N)
    if body.get("response_format") not in (None, "b64_json"):
        raise BadRequest("response_format", "only b64_json is supported (no image URLs)")
    width = height = 0
    size = body.get("size")
    if size not in (None, "", "auto"):
        match = _SIZE.match(str(size))
        if match is None:
            raise BadRequest("size", "size must look like 512x512")
        width, height = int(match.group(1)), int(match.group(2))
    guidance = _number(body, "guidance_scale", 0.0, 1000.0) or 0.0
    seed = _int(body, "seed", 0, low=-(2**63))
    user = _user(body)
    stem = uuid.uuid4().hex
    requests = tuple(
        inference_service_pb2.GenerateRequest(
            request_id=f"img-{stem}-{i}",
            prompt=prompt,
            seed=seed + i,
            num_inference_steps=_int(body, "num_inference_steps", 0),
            width=width,
            height=height,
            guidance_scale=guidance,
        )
        for i in range(n)
    )
    return Parsed(requests, n=n, params={"width": "size", "height": "size"}, user=user)
