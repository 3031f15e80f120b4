"""The S3 fetcher against a real S3-protocol server that checks signatures (moto's server,
tests/worker/s3_server.py): listing page by page, a fetched tiny model loads and serves, a
second run downloads nothing, a changed object alone is fetched again, a deleted one is
removed, a wrong secret is refused by the server, and offline a complete record is used."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage_worker.fetch import RECORD, FetchError
from omnistage_worker.fetch_s3 import Bucket, fetch_s3, parse_list_page
from omnistage_worker.sigv4 import Credentials
from tests.worker.conftest import StartWorker
from tests.worker.s3_server import LocalS3

PREFIX = "org/tiny llama"  # a space: keys are encoded once, in the URL and the signature


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_fetch_then_cache_then_changed_then_offline(lm_dir: Path, tmp_path: Path) -> None:
    dest = tmp_path / "models" / "tiny-llama"
    with LocalS3() as s3:
        count = s3.put_dir(PREFIX, lm_dir)
        s3.put(f"{PREFIX}/", b"")  # a directory marker, not a file
        s3.put("org/tiny llama-other/config.json", b"{}")  # shares the prefix's text only
        bucket = Bucket(s3.url, s3.bucket, path_style=True)
        total = sum(len(b) for b in _files(lm_dir).values())
        assert fetch_s3(bucket, PREFIX, dest, credentials=s3.keys, page_size=2) == (count, total)
        assert {k: v for k, v in _files(dest).items() if k != RECORD} == _files(lm_dir)
        listings, downloads = s3.gets()
        assert listings == (count + 2) // 2 and downloads == count  # pages of 2 keys, marker too

        assert fetch_s3(bucket, PREFIX, dest, credentials=s3.keys) == (count, 0)
        assert s3.gets() == (listings + 1, downloads)  # listed once more, nothing fetched

        changed = (lm_dir / "config.json").read_bytes() + b"\n"
        s3.put(f"{PREFIX}/config.json", changed)
        assert fetch_s3(bucket, PREFIX, dest, credentials=s3.keys) == (count, len(changed))
        assert (dest / "config.json").read_bytes() == changed
        assert s3.gets()[1] == downloads + 1  # only the changed object

        s3.delete(f"{PREFIX}/generation_config.json")
        assert fetch_s3(bucket, PREFIX, dest, credentials=s3.keys) == (count - 1, 0)
        assert not (dest / "generation_config.json").exists()

        secret = s3.keys.secret_access_key
        other_last = "y" if secret.endswith("x") else "x"  # a random secret may already end in x
        wrong = Credentials(s3.keys.access_key_id, secret[:-1] + other_last)
        with pytest.raises(FetchError, match="HTTP 403 SignatureDoesNotMatch"):
            fetch_s3(bucket, PREFIX, tmp_path / "other", credentials=wrong)
        unknown = Credentials("AKIAUNKNOWNKEY000000", s3.keys.secret_access_key)
        with pytest.raises(FetchError, match="HTTP 403 InvalidAccessKeyId"):
            fetch_s3(bucket, PREFIX, tmp_path / "other", credentials=unknown)
        assert not (tmp_path / "other").exists()
    # The store is gone: the complete record is used as it is; without one, a clear error.
    assert fetch_s3(bucket, PREFIX, dest, credentials=s3.keys, timeout=2) == (count - 1, 0)
    with pytest.raises(FetchError, match=s3.url):
        fetch_s3(bucket, PREFIX, tmp_path / "empty", credentials=s3.keys, timeout=2)


async def test_the_fetched_model_serves(
    start_worker: StartWorker, lm_dir: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "fetched"
    with LocalS3() as s3:
        s3.put_dir(PREFIX, lm_dir)
        env = {
            **os.environ,
            "AWS_ACCESS_KEY_ID": s3.keys.access_key_id,
            "AWS_SECRET_ACCESS_KEY": s3.keys.secret_access_key,
        }
        command = [sys.executable, "-m", "omnistage_worker.fetch_s3", "--endpoint", s3.url,
                   "--bucket", s3.bucket, "--prefix", PREFIX, "--path-style",
                   "--dest", str(dest)]  # fmt: skip
        proc = await asyncio.to_thread(
            subprocess.run, command, capture_output=True, text=True, timeout=120, check=False,
            env=env,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert "downloaded" in proc.stdout

        env["AWS_SECRET_ACCESS_KEY"] = "wrong"
        refused = await asyncio.to_thread(
            subprocess.run,
            [*command[:-1], str(tmp_path / "refused")],
            capture_output=True, text=True, timeout=120, check=False, env=env,
        )  # fmt: skip
    assert refused.returncode == 2
    line = refused.stderr.strip()
    assert line.startswith("omnistage fetch: ") and "SignatureDoesNotMatch" in line
    assert len(line.splitlines()) == 1
    worker = await start_worker(dest, "ar", "transformers")
    await worker.server.wait_loaded()
    answer = await worker.generate(prompt="hello", max_new_tokens=4)
    assert answer.WhichOneof("output") == "text"


def _page(keys: list[str], truncated: str = "false", token: str = "") -> bytes:
    contents = "".join(
        f"<Contents><Key>{k}</Key><ETag>&quot;e&quot;</ETag><Size>1</Size></Contents>" for k in keys
    )
    tail = f"<NextContinuationToken>{token}</NextContinuationToken>" if token else ""
    return (
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"{contents}<IsTruncated>{truncated}</IsTruncated>{tail}</ListBucketResult>"
    ).encode()


def test_listing_pages_are_parsed() -> None:
    objects, token = parse_list_page(_page(["p/a", "p/b"], "true", "t/+="))
    assert [(o.key, o.etag, o.size) for o in objects] == [("p/a", '"e"', 1), ("p/b", '"e"', 1)]
    assert token == "t/+="
    assert parse_list_page(_page(["p/c"]))[1] is None
    with pytest.raises(FetchError, match="truncated without a continuation token"):
        parse_list_page(_page(["p/a"], "true"))


def test_keys_that_leave_the_directory_are_refused(tmp_path: Path) -> None:
    with LocalS3() as s3:
        s3.put("m/../../escape", b"x")
        with pytest.raises(FetchError, match="leaves the model directory"):
            fetch_s3(Bucket(s3.url, s3.bucket, path_style=True), "m", tmp_path / "d",
                     credentials=s3.keys)  # fmt: skip
    assert not (tmp_path / "escape").exists()


def test_virtual_hosted_addressing() -> None:
    bucket = Bucket("https://s3.example:8443/base/", "models")
    assert bucket.url("a b/c.json") == "https://models.s3.example:8443/base/a%20b/c.json"
    assert bucket.url(query="list-type=2") == "https://models.s3.example:8443/base/?list-type=2"
    path_style = Bucket("https://s3.example", "models", path_style=True)
    assert path_style.url(query="list-type=2") == "https://s3.example/models?list-type=2"
