"""``spec.limits`` and ``spec.http``: bounds on one request and the HTTP API's bearer token.

Pure parsing and the worker flags and volume they become. ``spec.limits`` (all optional):
``requestBodyBytes`` (a body over it: 413), ``promptTokens``, ``imageSide`` (pixels) and
``frames``; a request over a bound is refused 400 naming the field before it is queued. The
defaults equal the worker's (:mod:`omnistage_worker.limits`), chosen so one request stays within
what a measured footprint covers. ``maxBatch``: how many requests the stage runs together (rows
of an AR decode batch, images of one diffusion call; the worker's ``--max-batch``).
``spec.http.authSecret`` names a Secret (and its ``key``, default ``token``) whose value the
OpenAI HTTP API then requires as a bearer token; it is mounted read-only into the worker and
passed as ``--http-token-file``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "HTTP_TOKEN_DIR",
    "HTTP_TOKEN_VOLUME",
    "SERVING_ARGS",
    "Serving",
    "ServingError",
    "parse_serving",
    "serving_args",
    "serving_volume",
]

MI: Final = 1024 * 1024
DEFAULT_REQUEST_BODY_BYTES: Final = 1 * MI
DEFAULT_PROMPT_TOKENS: Final = 8192
DEFAULT_IMAGE_SIDE: Final = 2048
DEFAULT_FRAMES: Final = 129
DEFAULT_MAX_BATCH: Final = 32
DEFAULT_AUTH_KEY: Final = "token"
# The CRD's bounds (checked again here for a body that skipped the API server).
BOUNDS: Final[Mapping[str, tuple[int, int]]] = {
    "requestBodyBytes": (1024, 64 * MI),
    "promptTokens": (1, 1048576),
    "imageSide": (64, 16384),
    "frames": (1, 4097),
    "maxBatch": (1, 1024),
}
HTTP_TOKEN_DIR: Final = "/var/run/secrets/omnistage-http"
HTTP_TOKEN_VOLUME: Final = "omnistage-http-token"
# The worker flags these set; spec.worker.args may not set them.
SERVING_ARGS: Final = frozenset(
    {
        "--max-request-bytes",
        "--max-prompt-tokens",
        "--max-image-side",
        "--max-frames",
        "--max-batch",
        "--http-token-file",
    }
)
_SECRET_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_SECRET_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


class ServingError(ValueError):
    """An invalid ``spec.limits`` or ``spec.http`` field; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class Serving:
    """``spec.limits`` and ``spec.http`` (``auth_secret`` None: the HTTP API is open)."""

    request_body_bytes: int = DEFAULT_REQUEST_BODY_BYTES
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS
    image_side: int = DEFAULT_IMAGE_SIDE
    frames: int = DEFAULT_FRAMES
    max_batch: int = DEFAULT_MAX_BATCH
    auth_secret: str | None = None
    auth_key: str = DEFAULT_AUTH_KEY


def _object(value: Any, path: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ServingError(path, f"must be an object, got {type(value).__name__}")
    return value


def _bounded(limits: Mapping[str, Any], key: str, default: int) -> int:
    value = limits.get(key)
    if value is None:
        return default
    low, high = BOUNDS[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ServingError(f"spec.limits.{key}", f"must be an integer from {low} to {high}")
    return value


def parse_serving(spec: Mapping[str, Any]) -> Serving:
    """``spec.limits`` and ``spec.http`` of a stage's spec (defaults for what is unset)."""
    limits = _object(spec.get("limits"), "spec.limits")
    unknown = set(limits) - set(BOUNDS)
    if unknown:
        raise ServingError(f"spec.limits.{sorted(unknown)[0]}", "unknown field")
    auth = _object(_object(spec.get("http"), "spec.http").get("authSecret"), "spec.http.authSecret")
    name = auth.get("name")
    key = auth.get("key", DEFAULT_AUTH_KEY)
    if auth and (not isinstance(name, str) or not _SECRET_NAME.match(name) or len(name) > 253):
        raise ServingError("spec.http.authSecret.name", "must name a Secret")
    if not isinstance(key, str) or not _SECRET_KEY.match(key):
        raise ServingError("spec.http.authSecret.key", "must be a Secret key")
    return Serving(
        request_body_bytes=_bounded(limits, "requestBodyBytes", DEFAULT_REQUEST_BODY_BYTES),
        prompt_tokens=_bounded(limits, "promptTokens", DEFAULT_PROMPT_TOKENS),
        image_side=_bounded(limits, "imageSide", DEFAULT_IMAGE_SIDE),
        frames=_bounded(limits, "frames", DEFAULT_FRAMES),
        max_batch=_bounded(limits, "maxBatch", DEFAULT_MAX_BATCH),
        auth_secret=name if auth else None,
        auth_key=key,
    )


def serving_args(serving: Serving) -> list[str]:
    """The worker flags of the bounds set away from the default (the worker's defaults are
    these same values), and the token file when the API needs a token."""
    default = Serving()
    args: list[str] = []
    for flag, value, usual in (
        ("--max-request-bytes", serving.request_body_bytes, default.request_body_bytes),
        ("--max-prompt-tokens", serving.prompt_tokens, default.prompt_tokens),
        ("--max-image-side", serving.image_side, default.image_side),
        ("--max-frames", serving.frames, default.frames),
        ("--max-batch", serving.max_batch, default.max_batch),
    ):
        if value != usual:
            args += [flag, str(value)]
    if serving.auth_secret is not None:
        args += ["--http-token-file", f"{HTTP_TOKEN_DIR}/{serving.auth_key}"]
    return args


def serving_volume(serving: Serving) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The token Secret's (mount, volume) for the worker, or None without ``authSecret``."""
    if serving.auth_secret is None:
        return None
    mount = {"name": HTTP_TOKEN_VOLUME, "mountPath": HTTP_TOKEN_DIR, "readOnly": True}
    volume = {
        "name": HTTP_TOKEN_VOLUME,
        "secret": {
            "secretName": serving.auth_secret,
            "items": [{"key": serving.auth_key, "path": serving.auth_key}],
            "defaultMode": 0o400,
        },
    }
    return mount, volume
