"""Which request fields a vLLM stage refuses at its front: those vLLM's server would ignore.

vLLM's OpenAI request models accept any extra field, log it at debug level and serve the
request without it (OpenAI's ``best_of``, ``modalities``, ``functions``, a misspelt name). A
stage refuses what it cannot honour, so the front refuses a top-level field that the route's
request model does not define, with a 400 naming it, before the request is held or queued.
"""

from __future__ import annotations

import json
from typing import Any

from omnistage_worker.serving.openai_api import error_body

#: vLLM's routes whose bodies are checked (the ones that run the engine on a prompt).
CHECKED_ROUTES = ("/v1/completions", "/v1/chat/completions")


def unknown_field(body: bytes, accepted: frozenset[str]) -> str | None:
    """The first top-level key of a JSON object ``body`` that is not in ``accepted``; None
    when every key is known, or when the body is not a JSON object (vLLM's own validation
    answers that one)."""
    try:
        parsed: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    return next((str(key) for key in parsed if key not in accepted), None)


def refusal(field: str, route: str) -> dict[str, Any]:
    """The OpenAI error body for an unknown ``field`` on ``route``."""
    message = (
        f"unknown field {field!r}: {route} of this vLLM stage does not define it (vLLM's "
        "server would ignore it), so the stage refuses it"
    )
    return error_body(message, "invalid_request_error", field, "invalid_value")
