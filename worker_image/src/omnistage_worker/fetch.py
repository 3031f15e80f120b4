"""Fetch a model from a Hugging Face-compatible hub into a directory, once: the worker pod's
init step for ``spec.model.source``.

    python3 -m omnistage_worker.fetch --hub URL --repo ORG/NAME [--revision main] --dest DIR

The hub protocol (what the Hugging Face Hub and its mirrors serve):
``GET {hub}/api/models/{repo}/revision/{revision}`` answers ``{"sha": ..., "siblings":
[{"rfilename": ...}, ...]}``, and ``GET {hub}/{repo}/resolve/{sha}/{rfilename}`` a file
(redirects followed). A token (``--token-file`` or ``$HF_TOKEN``) goes as a bearer token.

The cache is ``DEST`` itself: ``DEST/.omnistage-source.json`` records the hub, repo, resolved
commit and each file's size, written after the last file. A run that resolves the same commit
and finds every file at its size downloads nothing, so a volume that outlives the pod (a
PersistentVolumeClaim) makes a replaced pod start without a download. Each file is written
under a temporary name and renamed. When the hub cannot be reached, a complete record for the
same repo and revision is used as it is. Errors end the process with status 2 and one line
naming the cause.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, Final

import httpx

RECORD: Final = ".omnistage-source.json"
CHUNK: Final = 1 << 20


class FetchError(Exception):
    """The model cannot be fetched; the message says why."""


@dataclass(frozen=True)
class Listing:
    """A resolved revision: its commit and files with sizes (None: unknown until fetched)."""

    sha: str
    files: Mapping[str, int | None]


def safe_name(name: str) -> str:
    """A repository file name that stays inside the destination, or FetchError."""
    path = PurePosixPath(name)
    if not name or path.is_absolute() or ".." in path.parts or name == RECORD:
        raise FetchError(f"the hub lists a file name that leaves the model directory: {name!r}")
    return name


def parse_listing(body: Any) -> Listing:
    """The hub's revision answer as a ``Listing`` (pure)."""
    if not isinstance(body, Mapping) or not isinstance(body.get("sha"), str):
        raise FetchError("the hub's revision answer has no commit sha")
    files: dict[str, int | None] = {}
    for sibling in body.get("siblings") or []:
        name = safe_name(str(sibling.get("rfilename", "")))
        size = sibling.get("size")
        files[name] = size if isinstance(size, int) else None
    if not files:
        raise FetchError("the hub lists no files for this revision")
    return Listing(sha=body["sha"], files=files)


def cached(record: Mapping[str, Any] | None, hub: str, repo: str, sha: str, dest: Path) -> bool:
    """Whether ``dest`` already holds commit ``sha`` of ``repo`` completely (pure but stat)."""
    if not record or (record.get("hub"), record.get("repo"), record.get("sha")) != (hub, repo, sha):
        return False
    files = record.get("files") or {}
    return bool(files) and all(
        (dest / name).is_file() and (dest / name).stat().st_size == size
        for name, size in files.items()
    )


def read_record(dest: Path) -> dict[str, Any] | None:
    """The cache record in ``dest`` (None when absent or unreadable)."""
    try:
        data = json.loads((dest / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _download(client: httpx.Client, url: str, target: Path) -> int:
    partial = target.with_name(f".{target.name}.partial")
    target.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    with client.stream("GET", url) as response:
        _check(response, url)
        with partial.open("wb") as out:
            for chunk in response.iter_bytes(CHUNK):
                out.write(chunk)
                size += len(chunk)
    os.replace(partial, target)
    return size


def _check(response: httpx.Response, url: str) -> None:
    if response.status_code in (401, 403):
        raise FetchError(f"{url}: HTTP {response.status_code} (a token? --token-file, $HF_TOKEN)")
    if response.status_code != 200:
        raise FetchError(f"{url}: HTTP {response.status_code}")


def fetch(
    hub: str, repo: str, revision: str, dest: Path, *, token: str | None = None, timeout: float = 60
) -> tuple[str, int]:
    """Make ``dest`` hold ``repo`` at ``revision``: (the commit, bytes downloaded)."""
    hub = hub.rstrip("/")
    headers = {"authorization": f"Bearer {token}"} if token else {}
    record = read_record(dest)
    with httpx.Client(headers=headers, timeout=timeout, follow_redirects=True) as client:
        url = f"{hub}/api/models/{repo}/revision/{revision}"
        try:
            response = client.get(url)
        except httpx.TransportError as exc:
            if record and (record.get("repo"), record.get("revision")) == (repo, revision):
                sha = str(record.get("sha"))
                if cached(record, str(record.get("hub")), repo, sha, dest):
                    print(f"hub unreachable ({exc}); using the cached {repo}@{sha}", flush=True)
                    return sha, 0
            raise FetchError(f"{url}: {exc}") from None
        _check(response, url)
        listing = parse_listing(response.json())
        if cached(record, hub, repo, listing.sha, dest):
            return listing.sha, 0
        dest.mkdir(parents=True, exist_ok=True)
        (dest / RECORD).unlink(missing_ok=True)  # incomplete until every file is in
        sizes: dict[str, int] = {}
        downloaded = 0
        for name in listing.files:
            target = dest / name
            known = listing.files[name]
            if known is not None and target.is_file() and target.stat().st_size == known:
                sizes[name] = known  # this file of the commit is already here
                continue
            size = _download(client, f"{hub}/{repo}/resolve/{listing.sha}/{name}", target)
            sizes[name] = size
            downloaded += size
    body = {"hub": hub, "repo": repo, "revision": revision, "sha": listing.sha, "files": sizes}
    temporary = dest / f".{RECORD}.partial"
    temporary.write_text(json.dumps(body, indent=1, sort_keys=True))
    os.replace(temporary, dest / RECORD)
    return listing.sha, downloaded


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnistage_worker.fetch", description=__doc__.split("\n")[0])
    p.add_argument("--hub", required=True, help="hub URL, e.g. https://huggingface.co")
    p.add_argument("--repo", required=True, help="model repository, ORG/NAME")
    p.add_argument("--revision", default="main", help="branch, tag or commit (default main)")
    p.add_argument("--dest", required=True, type=Path, help="the model directory to fill")
    p.add_argument("--token-file", type=Path, help="bearer token file (default: $HF_TOKEN)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds per HTTP request")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point (``python3 -m omnistage_worker.fetch``)."""
    args = _parser().parse_args(argv)
    token = os.environ.get("HF_TOKEN") or None
    if args.token_file is not None:
        token = args.token_file.read_text().strip() or None
    try:
        sha, downloaded = fetch(
            args.hub, args.repo, args.revision, args.dest, token=token, timeout=args.timeout
        )
    except FetchError as exc:
        print(f"omnistage fetch: {exc}", file=sys.stderr, flush=True)
        return 2
    what = f"downloaded {downloaded} bytes" if downloaded else "already cached"
    print(f"{args.repo}@{sha} in {args.dest}: {what}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
