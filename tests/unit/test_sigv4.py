"""Signature Version 4 against AWS's worked examples (the S3 developer guide's "Examples:
signature calculations" with its example key pair, and the general reference's derived
signing key). Each expected value is the one printed in that documentation; the signer
against a real server that checks signatures: tests/worker/test_fetch_s3.py."""

from __future__ import annotations

import hashlib

import pytest

from omnistage_worker.sigv4 import (
    EMPTY_SHA256,
    Credentials,
    canonical_query,
    canonical_request,
    sign,
    signing_key,
    string_to_sign,
)

KEYS = Credentials("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY")
BUCKET = "https://examplebucket.s3.amazonaws.com"
WHEN = "20130524T000000Z"
SCOPE = "AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request"


def test_get_object_canonical_request_and_string_to_sign() -> None:
    headers = {
        "Host": "examplebucket.s3.amazonaws.com",
        "Range": "bytes=0-9",
        "x-amz-content-sha256": EMPTY_SHA256,
        "x-amz-date": WHEN,
    }
    request, names = canonical_request("GET", "/test.txt", "", headers, EMPTY_SHA256)
    assert request == (
        "GET\n/test.txt\n\nhost:examplebucket.s3.amazonaws.com\nrange:bytes=0-9\n"
        f"x-amz-content-sha256:{EMPTY_SHA256}\nx-amz-date:{WHEN}\n\n"
        f"host;range;x-amz-content-sha256;x-amz-date\n{EMPTY_SHA256}"
    )
    assert names == "host;range;x-amz-content-sha256;x-amz-date"
    assert string_to_sign(WHEN, "20130524/us-east-1/s3/aws4_request", request) == (
        "AWS4-HMAC-SHA256\n20130524T000000Z\n20130524/us-east-1/s3/aws4_request\n"
        "7344ae5b7ee6c3e7e6b0fe0640412a37625d1fbfff95c48bbb2dc43964946972"
    )


@pytest.mark.parametrize(
    ("method", "url", "headers", "body", "expected"),
    [
        ("GET", f"{BUCKET}/test.txt", {"Range": "bytes=0-9"}, b"",
         ("host;range;x-amz-content-sha256;x-amz-date",
          "f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")),
        ("GET", f"{BUCKET}/?max-keys=2&prefix=J", {}, b"",
         ("host;x-amz-content-sha256;x-amz-date",
          "34b48302e7b5fa45bde8084f4b7868a86f0a534bc59db6670ed5711ef69dc6f7")),
        ("GET", f"{BUCKET}/?lifecycle", {}, b"",
         ("host;x-amz-content-sha256;x-amz-date",
          "fea454ca298b7da1c68078a5d1bdbfbbe0d65c699e0f91ac7a200a0136783543")),
        ("PUT", f"{BUCKET}/test%24file.text",
         {"Date": "Fri, 24 May 2013 00:00:00 GMT", "x-amz-storage-class": "REDUCED_REDUNDANCY"},
         b"Welcome to Amazon S3.",
         ("date;host;x-amz-content-sha256;x-amz-date;x-amz-storage-class",
          "98ad721746da40c64f1a55b78f14c238d841ea1380cd77a1b5971af0ece108bd")),
    ],
)  # fmt: skip
def test_the_documented_s3_signatures(
    method: str, url: str, headers: dict[str, str], body: bytes, expected: tuple[str, str]
) -> None:
    signed, value = expected
    payload = hashlib.sha256(body).hexdigest()
    out = sign(method, url, headers, KEYS, region="us-east-1", amz_date=WHEN, payload_hash=payload)
    assert out["authorization"] == (
        f"AWS4-HMAC-SHA256 Credential={SCOPE}, SignedHeaders={signed}, Signature={value}"
    )
    assert (out["host"], out["x-amz-date"], out["x-amz-content-sha256"]) == (
        "examplebucket.s3.amazonaws.com", WHEN, payload,
    )  # fmt: skip


def test_the_documented_signing_key() -> None:
    key = signing_key("wJalrXUtnFEMI/K7MDENG+bPxRfiCYEXAMPLEKEY", "20120215", "us-east-1", "iam")
    assert key.hex() == "f4780e2d9f65fa895f9c67b32ce1baf0b0d8a43505a000a1a9e090d414db404d"


def test_query_pairs_are_encoded_once_and_sorted() -> None:
    # a continuation token as a server returns it, percent-encoded in the URL once
    query = "prefix=models%2Ftiny%20llama%2F&list-type=2&continuation-token=a%2Bb%3D%3D&max-keys=2"
    assert canonical_query(query) == (
        "continuation-token=a%2Bb%3D%3D&list-type=2&max-keys=2&prefix=models%2Ftiny%20llama%2F"
    )


def test_a_session_token_is_signed() -> None:
    keys = Credentials(KEYS.access_key_id, KEYS.secret_access_key, "session")
    out = sign("GET", f"{BUCKET}/test.txt", {}, keys, region="us-east-1", amz_date=WHEN)
    assert out["x-amz-security-token"] == "session"
    assert "x-amz-security-token" in out["authorization"].split("SignedHeaders=")[1]
