"""The pure parts of the worker's TokenReview check: verdicts, the cache, the settings."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from omnistage_worker.serving.token_review import (
    ReviewCache,
    bearer_of,
    in_cluster_server,
    judge,
    remaining_s,
    review_body,
)
from omnistage_worker.token_review_settings import TokenReviewSettings

OPERATOR = "system:serviceaccount:omnistage-system:omnistage-operator"
AUD = "omnistage-worker"


def _review(authenticated: bool = True, user: str = OPERATOR, aud: str = AUD) -> dict[str, Any]:
    return {
        "status": {
            "authenticated": authenticated,
            "user": {"username": user},
            "audiences": [aud],
            **({} if authenticated else {"error": "token has expired"}),
        }
    }


def test_review_body_sets_the_audience() -> None:
    body = review_body("t", AUD)
    assert body["kind"] == "TokenReview" and body["spec"] == {"token": "t", "audiences": [AUD]}


def test_judge() -> None:
    assert judge(_review(), OPERATOR, AUD) is None
    assert "token has expired" in (judge(_review(authenticated=False), OPERATOR, AUD) or "")
    other = "system:serviceaccount:team-a:default"
    assert "team-a:default" in (judge(_review(user=other), OPERATOR, AUD) or "")
    assert "audience" in (judge(_review(aud="api"), OPERATOR, AUD) or "")
    assert judge({}, OPERATOR, AUD) is not None


def test_remaining_s() -> None:
    claims = base64.urlsafe_b64encode(json.dumps({"exp": 1000}).encode()).decode().rstrip("=")
    assert remaining_s(f"h.{claims}.s", now=990.0) == 10.0
    assert remaining_s("opaque", now=0) is None
    assert remaining_s("h.!!.s", now=0) is None


def test_bearer_of() -> None:
    assert bearer_of("Bearer abc") == "abc"
    assert bearer_of(b"bearer abc ") == "abc"
    assert bearer_of("Basic abc") is None
    assert bearer_of("Bearer ") is None
    assert bearer_of(None) is None


def test_cache_ttl_and_size() -> None:
    now = [0.0]
    cache = ReviewCache(ttl_s=10, size=2, clock=lambda: now[0])
    cache.remember("a")
    assert cache.hit("a") and not cache.hit("b")
    now[0] = 10.0
    assert not cache.hit("a") and len(cache) == 0  # expired entries are dropped
    for token in ("a", "b", "c"):
        cache.remember(token)
    assert len(cache) == 2 and not cache.hit("a") and cache.hit("c")
    cache.remember("d", lifetime_s=3)  # a token expiring sooner than the TTL
    now[0] = 13.0
    assert not cache.hit("d")
    cache.remember("e", lifetime_s=-1)  # already expired
    assert not cache.hit("e")
    off = ReviewCache(ttl_s=0, size=2)
    off.remember("a")
    assert not off.hit("a")


def test_settings_refuse_bad_identity_and_missing_server() -> None:
    with pytest.raises(ValueError, match="--operator-identity"):
        TokenReviewSettings(operator_identity="omnistage-operator", server="https://x")
    with pytest.raises(ValueError, match="--kube-server"):
        TokenReviewSettings(operator_identity=OPERATOR)
    with pytest.raises(ValueError, match="--token-audience"):
        TokenReviewSettings(operator_identity=OPERATOR, server="https://x", audience="")
    assert in_cluster_server({}) == ""
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT": "443"}
    assert in_cluster_server(env) == "https://[fd00::1]:443"
