"""Fetch a model from an S3-compatible object store into a directory, once: the worker pod's
init step for ``spec.model.source.s3``.

    python3 -m omnistage_worker.fetch_s3 --endpoint URL --bucket NAME [--prefix P]
        [--region us-east-1] [--path-style] --dest DIR

The S3 protocol spoken here: ``ListObjectsV2`` (``GET /?list-type=2&prefix=...``, following
``NextContinuationToken`` while the answer is truncated) names the objects under the prefix
with their ETags and sizes; ``GetObject`` (``GET /KEY`` with ``If-Match: ETAG``) streams each
one. Requests are signed with Signature Version 4 (:mod:`omnistage_worker.sigv4`) when
``$AWS_ACCESS_KEY_ID`` and ``$AWS_SECRET_ACCESS_KEY`` are set (``$AWS_SESSION_TOKEN`` too for
temporary credentials), anonymous otherwise. The bucket is addressed as
``{endpoint}/{bucket}/KEY`` with ``--path-style``, as ``{bucket}.{endpoint host}/KEY``
without. A key's file name is the key less the prefix (a prefix is a directory: ``/`` is
added).

The cache is ``DEST`` itself, as for the hub (:mod:`omnistage_worker.fetch`): the record
``DEST/.omnistage-source.json`` holds the endpoint, bucket, prefix and each object's ETag and
size, written after the last file. An object whose ETag and size match the record and whose
file is there at that size is not downloaded again, so a volume that outlives the pod makes a
replaced pod start without a download; files of objects gone from the listing are removed.
When the store cannot be reached, a complete record for the same bucket and prefix is used as
it is. Errors end the process with status 2 and one line naming the cause (the store's error
code included, such as ``SignatureDoesNotMatch``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlsplit

import httpx

from omnistage_worker.fetch import CHUNK, RECORD, FetchError, read_record, safe_name
from omnistage_worker.sigv4 import Credentials, sign

__all__ = ["Bucket", "S3Object", "fetch_s3", "main", "parse_list_page", "unchanged"]

_NS: Final = "{http://s3.amazonaws.com/doc/2006-03-01/}"
_SAFE: Final = "-_.~"


@dataclass(frozen=True)
class S3Object:
    """One listed object: its key, ETag (quotes kept, as the store sends it) and size."""

    key: str
    etag: str
    size: int


@dataclass(frozen=True)
class Bucket:
    """Where the objects are and how requests reach them."""

    endpoint: str
    name: str
    region: str = "us-east-1"
    path_style: bool = False

    def url(self, key: str = "", query: str = "") -> str:
        """The URL of ``key`` (the bucket itself when empty), ``query`` already encoded."""
        parts = urlsplit(self.endpoint)
        base = parts.path.rstrip("/")
        if self.path_style:
            origin, path = f"{parts.scheme}://{parts.netloc}", f"{base}/{self.name}"
        else:
            origin, path = f"{parts.scheme}://{self.name}.{parts.netloc}", base
        path = f"{path}/{quote(key, safe=_SAFE + '/')}" if key or not self.path_style else path
        return f"{origin}{path}" + (f"?{query}" if query else "")


def _query(**pairs: str) -> str:
    return "&".join(f"{name.replace('_', '-')}={quote(v, safe=_SAFE)}" for name, v in pairs.items())


def _text(node: ET.Element, tag: str) -> str:
    child = node.find(f"{_NS}{tag}")
    if child is None:
        child = node.find(tag)  # (a store that leaves the namespace out)
    return "" if child is None or child.text is None else child.text


def parse_list_page(body: bytes) -> tuple[list[S3Object], str | None]:
    """A ``ListObjectsV2`` answer: its objects and the next continuation token (pure)."""
    try:
        root = ET.fromstring(body)
    except ET.ParseError as exc:
        raise FetchError(f"the store's listing is not XML: {exc}") from None
    objects = []
    for node in [*root.iter(f"{_NS}Contents"), *root.iter("Contents")]:
        size = _text(node, "Size")
        if not size.isdigit():
            raise FetchError(f"the store lists {_text(node, 'Key')!r} without a size")
        objects.append(S3Object(key=_text(node, "Key"), etag=_text(node, "ETag"), size=int(size)))
    truncated = _text(root, "IsTruncated").lower() == "true"
    token = _text(root, "NextContinuationToken")
    if truncated and not token:
        raise FetchError("the store's listing is truncated without a continuation token")
    return objects, token if truncated else None


def _names(objects: Sequence[S3Object], prefix: str) -> dict[str, S3Object]:
    """File name -> object, directory markers (keys ending in ``/``) left out."""
    return {safe_name(obj.key[len(prefix) :]): obj for obj in objects if not obj.key.endswith("/")}


def unchanged(record: Mapping[str, Any] | None, name: str, obj: S3Object, dest: Path) -> bool:
    """Whether ``dest/name`` already holds ``obj`` by the record (pure but stat)."""
    entry = ((record or {}).get("objects") or {}).get(name) or {}
    target = dest / name
    return (
        (entry.get("etag"), entry.get("size")) == (obj.etag, obj.size)
        and target.is_file()
        and target.stat().st_size == obj.size
    )


class _Client:
    def __init__(self, bucket: Bucket, credentials: Credentials | None, timeout: float) -> None:
        self.bucket = bucket
        self.credentials = credentials
        self.http = httpx.Client(timeout=timeout)

    def _headers(self, url: str, extra: Mapping[str, str]) -> dict[str, str]:
        if self.credentials is None:
            return dict(extra)
        when = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        return sign("GET", url, extra, self.credentials, region=self.bucket.region, amz_date=when)

    def list(self, prefix: str, page_size: int) -> list[S3Object]:
        objects: list[S3Object] = []
        token: str | None = None
        while True:
            pairs = {"list_type": "2", "prefix": prefix, "max_keys": str(page_size)}
            if token is not None:
                pairs["continuation_token"] = token
            url = self.bucket.url(query=_query(**pairs))
            response = self.http.get(url, headers=self._headers(url, {}))
            _check(response, f"s3://{self.bucket.name}/{prefix}")
            page, token = parse_list_page(response.content)
            objects.extend(page)
            if token is None:
                return objects

    def download(self, obj: S3Object, target: Path) -> int:
        url = self.bucket.url(obj.key)
        partial = target.with_name(f".{target.name}.partial")
        target.parent.mkdir(parents=True, exist_ok=True)
        size = 0
        headers = self._headers(url, {"if-match": obj.etag} if obj.etag else {})
        with self.http.stream("GET", url, headers=headers) as response:
            _check(response, f"s3://{self.bucket.name}/{obj.key}")
            with partial.open("wb") as out:
                for chunk in response.iter_bytes(CHUNK):
                    out.write(chunk)
                    size += len(chunk)
        if size != obj.size:
            partial.unlink(missing_ok=True)
            raise FetchError(f"s3://{self.bucket.name}/{obj.key}: got {size} of {obj.size} bytes")
        os.replace(partial, target)
        return size


def _check(response: httpx.Response, what: str) -> None:
    if response.status_code == 200:
        return
    response.read()
    code = ""
    with contextlib.suppress(ET.ParseError):
        code = _text(ET.fromstring(response.content), "Code")
    hint = {
        403: " (check the credentials Secret, the region and the bucket's policy)",
        412: " (the object changed while fetching: run again)",
    }.get(response.status_code, "")
    raise FetchError(f"{what}: HTTP {response.status_code} {code}{hint}".replace("  ", " "))


def _record(bucket: Bucket, prefix: str) -> dict[str, str]:
    return {"s3": bucket.endpoint, "bucket": bucket.name, "prefix": prefix}


def fetch_s3(
    bucket: Bucket,
    prefix: str,
    dest: Path,
    *,
    credentials: Credentials | None = None,
    timeout: float = 60,
    page_size: int = 1000,
) -> tuple[int, int]:
    """Make ``dest`` hold the objects under ``prefix``: (objects, bytes downloaded)."""
    prefix = prefix.lstrip("/")
    prefix = prefix if not prefix or prefix.endswith("/") else f"{prefix}/"
    record = read_record(dest)
    same = record is not None and {k: record.get(k) for k in ("s3", "bucket", "prefix")} == (
        _record(bucket, prefix)
    )
    client = _Client(bucket, credentials, timeout)
    with client.http:
        try:
            listed = client.list(prefix, page_size)
        except httpx.TransportError as exc:
            known = (record or {}).get("objects") or {}
            if (
                same
                and known
                and all(
                    (dest / n).is_file() and (dest / n).stat().st_size == e.get("size")
                    for n, e in known.items()
                )
            ):
                print(f"store unreachable ({exc}); using the cached copy", flush=True)
                return len(known), 0
            raise FetchError(f"{bucket.url()}: {exc}") from None
        objects = _names(listed, prefix)
        if not objects:
            raise FetchError(f"no objects under s3://{bucket.name}/{prefix}")
        kept = record if same else None
        if (
            kept is not None
            and set(kept.get("objects") or {}) == set(objects)
            and all(unchanged(kept, n, o, dest) for n, o in objects.items())
        ):
            return len(objects), 0
        dest.mkdir(parents=True, exist_ok=True)
        (dest / RECORD).unlink(missing_ok=True)  # incomplete until every file is in
        downloaded = 0
        for name, obj in objects.items():
            if unchanged(kept, name, obj, dest):
                continue
            try:
                downloaded += client.download(obj, dest / name)
            except httpx.HTTPError as exc:  # (the store went away mid-way: run again)
                raise FetchError(f"{bucket.url(obj.key)}: {exc}") from None
    for name in set((kept or {}).get("objects") or {}) - set(objects):
        (dest / safe_name(name)).unlink(missing_ok=True)  # gone from the store
    entries = {n: {"etag": o.etag, "size": o.size} for n, o in objects.items()}
    temporary = dest / f".{RECORD}.partial"
    temporary.write_text(
        json.dumps({**_record(bucket, prefix), "objects": entries}, indent=1, sort_keys=True)
    )
    os.replace(temporary, dest / RECORD)
    return len(objects), downloaded


def credentials_from_env(env: Mapping[str, str]) -> Credentials | None:
    """The key pair in ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (None: anonymous)."""
    key, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")
    if not key or not secret:
        return None
    return Credentials(key, secret, env.get("AWS_SESSION_TOKEN") or None)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="omnistage_worker.fetch_s3", description=__doc__.split("\n")[0]
    )
    p.add_argument("--endpoint", required=True, help="the store's URL, e.g. https://s3.example")
    p.add_argument("--bucket", required=True, help="bucket name")
    p.add_argument("--prefix", default="", help="the model's key prefix (a directory)")
    p.add_argument("--region", default="us-east-1", help="signing region (default us-east-1)")
    p.add_argument("--path-style", action="store_true", help="address as ENDPOINT/BUCKET/KEY")
    p.add_argument("--dest", required=True, type=Path, help="the model directory to fill")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``python3 -m omnistage_worker.fetch_s3``)."""
    args = _parser().parse_args(argv)
    bucket = Bucket(args.endpoint, args.bucket, args.region, args.path_style)
    try:
        count, downloaded = fetch_s3(
            bucket,
            args.prefix,
            args.dest,
            credentials=credentials_from_env(os.environ),
            timeout=args.timeout,
        )
    except FetchError as exc:
        print(f"omnistage fetch: {exc}", file=sys.stderr, flush=True)
        return 2
    what = f"downloaded {downloaded} bytes" if downloaded else "already cached"
    print(f"s3://{args.bucket}/{args.prefix} ({count} objects) in {args.dest}: {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
