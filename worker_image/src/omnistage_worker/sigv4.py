"""AWS Signature Version 4 for S3 requests (pure: no I/O, no clock).

``sign(method, url, headers, credentials, region=, amz_date=)`` returns the headers to send:
the given ones plus ``host``, ``x-amz-date``, ``x-amz-content-sha256`` (unsigned payloads are
not used: the body's SHA-256, that of the empty string for a GET) and ``authorization``
(``AWS4-HMAC-SHA256 Credential=..., SignedHeaders=..., Signature=...``). Every header given is
signed. The canonical request, the string to sign and the signing key follow the published
algorithm step by step, each a function here so the tests can check them against AWS's own
worked examples.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import quote, unquote, urlsplit

__all__ = [
    "ALGORITHM",
    "EMPTY_SHA256",
    "Credentials",
    "canonical_request",
    "sign",
    "signature",
    "signing_key",
    "string_to_sign",
]

ALGORITHM: Final = "AWS4-HMAC-SHA256"
EMPTY_SHA256: Final = hashlib.sha256(b"").hexdigest()
_UNRESERVED: Final = "-_.~"  # with letters and digits: never percent-encoded


@dataclass(frozen=True)
class Credentials:
    """An access key pair, with the session token of temporary credentials."""

    access_key_id: str
    secret_access_key: str
    session_token: str | None = None


def _encode(text: str, *, keep_slash: bool) -> str:
    return quote(text, safe=_UNRESERVED + ("/" if keep_slash else ""))


def canonical_query(query: str) -> str:
    """The query string's pairs, each URI-encoded, sorted by name then value."""
    pairs = []
    for part in query.split("&") if query else []:
        name, _, value = part.partition("=")
        pairs.append(
            (_encode(unquote(name), keep_slash=False), _encode(unquote(value), keep_slash=False))
        )
    return "&".join(f"{n}={v}" for n, v in sorted(pairs))


def canonical_request(
    method: str, path: str, query: str, headers: Mapping[str, str], payload_hash: str
) -> tuple[str, str]:
    """(the canonical request, its signed-headers list) for S3 (the path is encoded once)."""
    folded = {name.lower(): " ".join(value.strip().split()) for name, value in headers.items()}
    names = sorted(folded)
    lines = [
        method,
        _encode(unquote(path or "/"), keep_slash=True),
        canonical_query(query),
        *(f"{name}:{folded[name]}" for name in names),
        "",
        ";".join(names),
        payload_hash,
    ]
    return "\n".join(lines), ";".join(names)


def scope(date: str, region: str, service: str) -> str:
    """The credential scope: ``YYYYMMDD/region/service/aws4_request``."""
    return f"{date}/{region}/{service}/aws4_request"


def string_to_sign(amz_date: str, credential_scope: str, request: str) -> str:
    """The string to sign for a canonical request at ``amz_date`` (``YYYYMMDDTHHMMSSZ``)."""
    digest = hashlib.sha256(request.encode()).hexdigest()
    return f"{ALGORITHM}\n{amz_date}\n{credential_scope}\n{digest}"


def _hmac(key: bytes, text: str) -> bytes:
    return hmac.new(key, text.encode(), hashlib.sha256).digest()


def signing_key(secret: str, date: str, region: str, service: str) -> bytes:
    """The key derived from the secret for one day, region and service."""
    key = _hmac(f"AWS4{secret}".encode(), date)
    for part in (region, service, "aws4_request"):
        key = _hmac(key, part)
    return key


def signature(key: bytes, text: str) -> str:
    """The hex HMAC-SHA256 of the string to sign."""
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign(
    method: str,
    url: str,
    headers: Mapping[str, str],
    credentials: Credentials,
    *,
    region: str,
    amz_date: str,
    payload_hash: str = EMPTY_SHA256,
    service: str = "s3",
) -> dict[str, str]:
    """The headers of a signed request to ``url`` (its path and query as they will be sent)."""
    parts = urlsplit(url)
    signed = {name.lower(): value for name, value in headers.items()}
    signed["host"] = parts.netloc
    signed["x-amz-date"] = amz_date
    signed["x-amz-content-sha256"] = payload_hash
    if credentials.session_token:
        signed["x-amz-security-token"] = credentials.session_token
    request, names = canonical_request(method, parts.path, parts.query, signed, payload_hash)
    credential_scope = scope(amz_date[:8], region, service)
    key = signing_key(credentials.secret_access_key, amz_date[:8], region, service)
    value = signature(key, string_to_sign(amz_date, credential_scope, request))
    signed["authorization"] = (
        f"{ALGORITHM} Credential={credentials.access_key_id}/{credential_scope}, "
        f"SignedHeaders={names}, Signature={value}"
    )
    return signed
