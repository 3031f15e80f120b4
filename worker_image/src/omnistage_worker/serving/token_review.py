"""Kubernetes-issued credentials for SleepService and DemandService: the operator presents a
short-lived ServiceAccount token with a dedicated audience; the worker asks the API server
(TokenReview, ``authentication.k8s.io/v1``, audiences set) through its own ServiceAccount and
accepts only the operator's identity.

Positive reviews are cached briefly (bounded TTL and size, and never past the token's ``exp``
claim, read once the API server has vouched for the token), keyed by the token's SHA-256, so a
token revoked (its pod or ServiceAccount deleted) is refused within ``cache_ttl_s``. Refusals
name the reason (UNAUTHENTICATED) but never the token. The pure parts (:func:`review_body`,
:func:`judge`, :func:`remaining_s`, :class:`ReviewCache`) have no I/O.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import ssl
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import httpx

from omnistage_worker.serving.auth import PROTECTED_PREFIXES, ProtectedMethodsInterceptor, bearer_of
from omnistage_worker.token_review_settings import TokenReviewSettings

__all__ = [
    "ReviewCache",
    "TokenReviewInterceptor",
    "TokenReviewer",
    "bearer_of",
    "in_cluster_server",
    "judge",
    "remaining_s",
    "review_body",
]

log = logging.getLogger(__name__)

_PATH = "/apis/authentication.k8s.io/v1/tokenreviews"


def in_cluster_server(env: Mapping[str, str] = os.environ) -> str:
    """``https://host:port`` of the ``kubernetes`` Service from the kubelet's variables, or ''."""
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT")
    if not host or not port:
        return ""
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


def remaining_s(token: str, now: float) -> float | None:
    """Seconds until the JWT's ``exp`` claim (None when it has none or is no JWT); trusted only
    after a TokenReview accepted the token."""
    parts = token.split(".")
    if len(parts) != 3:
        return None
    try:
        claims = json.loads(base64.urlsafe_b64decode(parts[1] + "=" * (-len(parts[1]) % 4)))
    except (ValueError, TypeError):
        return None
    exp = claims.get("exp") if isinstance(claims, dict) else None
    return float(exp) - now if isinstance(exp, int | float) else None


def review_body(token: str, audience: str) -> dict[str, Any]:
    """The TokenReview to create for ``token`` with ``audience``."""
    return {
        "apiVersion": "authentication.k8s.io/v1",
        "kind": "TokenReview",
        "spec": {"token": token, "audiences": [audience]},
    }


def judge(review: Mapping[str, Any], identity: str, audience: str) -> str | None:
    """Why a created TokenReview refuses the caller (None: it is ``identity`` for ``audience``)."""
    status = review.get("status") or {}
    if not status.get("authenticated"):
        error = status.get("error") or "not authenticated"
        return f"the API server did not authenticate the token: {error}"
    if audience not in (status.get("audiences") or []):
        return f"the token is not for audience {audience!r}"
    username = (status.get("user") or {}).get("username", "")
    if username != identity:
        return f"the token belongs to {username!r}, not the operator {identity!r}"
    return None


class ReviewCache:
    """Positive reviews by token digest, each valid ``ttl_s``, at most ``size`` (oldest out)."""

    def __init__(self, ttl_s: float, size: int, clock: Callable[[], float] = time.monotonic):
        self._ttl, self._size, self._clock = ttl_s, size, clock
        self._until: OrderedDict[str, float] = OrderedDict()

    @staticmethod
    def key(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def __len__(self) -> int:
        return len(self._until)

    def hit(self, token: str) -> bool:
        """Whether ``token`` was accepted less than the TTL ago (an expired entry is dropped)."""
        key = self.key(token)
        until = self._until.get(key)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[key]
            return False
        return True

    def remember(self, token: str, lifetime_s: float | None = None) -> None:
        """Record an accepted ``token`` (for the TTL, or its remaining ``lifetime_s`` if less)."""
        ttl = self._ttl if lifetime_s is None else min(self._ttl, lifetime_s)
        if ttl <= 0:
            return
        key = self.key(token)
        self._until.pop(key, None)
        self._until[key] = self._clock() + ttl
        while len(self._until) > self._size:
            self._until.popitem(last=False)


class TokenReviewer:
    """Asks the API server whether a token is the operator's (see :func:`judge`)."""

    def __init__(self, settings: TokenReviewSettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.cache = ReviewCache(settings.cache_ttl_s, settings.cache_size, clock)
        verify: Any = True
        if settings.ca_file is not None:
            verify = ssl.create_default_context(cafile=str(settings.ca_file))
        self._http = httpx.AsyncClient(
            base_url=settings.server, verify=verify, timeout=settings.timeout_s
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def refusal(self, token: str | None) -> str | None:
        """Why ``token`` is refused, or None when accepted."""
        if not token:
            return "this method needs 'authorization: Bearer <token>' metadata"
        if self.cache.hit(token):
            return None
        s = self.settings
        try:
            own = s.token_file.read_text(encoding="utf-8").strip()
            resp = await self._http.post(
                _PATH,
                json=review_body(token, s.audience),
                headers={"Authorization": f"Bearer {own}"},
            )
        except (OSError, httpx.HTTPError) as exc:
            log.warning("TokenReview failed: %s", exc)
            return f"the worker could not review the token: {type(exc).__name__}: {exc}"
        if resp.status_code != 201:
            reason = f"the API server answered the TokenReview with HTTP {resp.status_code}"
            log.warning("%s: %s", reason, resp.text[:300])
            return reason
        why = judge(resp.json(), s.operator_identity, s.audience)
        if why is None:
            self.cache.remember(token, remaining_s(token, time.time()))
        return why


class TokenReviewInterceptor(ProtectedMethodsInterceptor):
    """Refuses protected methods unless the bearer token reviews as the operator's."""

    def __init__(
        self, reviewer: TokenReviewer, prefixes: tuple[str, ...] = PROTECTED_PREFIXES
    ) -> None:
        super().__init__(prefixes)
        self._reviewer = reviewer

    async def refusal(self, header: str | bytes | None) -> str | None:
        return await self._reviewer.refusal(bearer_of(header))
