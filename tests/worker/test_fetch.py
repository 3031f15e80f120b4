"""The model fetcher against a local hub that speaks the Hugging Face Hub's protocol: a fetched
tiny model loads and serves, a second run downloads nothing, a new commit is fetched again, and
bad answers are refused with a clear line."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from omnistage_worker.fetch import RECORD, FetchError, fetch, parse_listing
from tests.worker.conftest import StartWorker
from tests.worker.hub_server import LocalHub

REPO = "tiny-org/tiny-llama"


def test_fetch_then_cache_then_new_commit(lm_dir: Path, tmp_path: Path) -> None:
    source = tmp_path / "repo"
    subprocess.run(["cp", "-r", str(lm_dir), str(source)], check=True)
    dest = tmp_path / "models" / "tiny-llama"
    with LocalHub({REPO: source}, token="hub-token") as hub:
        sha, downloaded = fetch(hub.url, REPO, "main", dest, token="hub-token")
        total = sum(p.stat().st_size for p in source.rglob("*") if p.is_file())
        assert (sha, downloaded) == (hub.sha(REPO), total)
        assert hub.hits["resolve"] == hub.hits["cdn"] == len(list(source.rglob("*.*")))
        for path in source.rglob("*"):
            if path.is_file():
                assert (dest / path.relative_to(source)).read_bytes() == path.read_bytes()
        assert (dest / RECORD).is_file()

        before = dict(hub.hits)
        assert fetch(hub.url, REPO, "main", dest, token="hub-token") == (sha, 0)
        assert hub.hits["cdn"] == before["cdn"] and hub.hits["api"] == before["api"] + 1

        (source / "config.json").write_text((source / "config.json").read_text() + "\n")
        new_sha, again = fetch(hub.url, REPO, "main", dest, token="hub-token")
        assert new_sha != sha and again == (source / "config.json").stat().st_size
        assert hub.hits["cdn"] == before["cdn"] + 1  # only the changed file

        with pytest.raises(FetchError, match="HTTP 401"):
            fetch(hub.url, REPO, "main", tmp_path / "other", token="wrong")
        url = hub.url
    # The hub is gone: the complete cache is used as it is.
    assert fetch(url, REPO, "main", dest, timeout=2) == (new_sha, 0)
    with pytest.raises(FetchError, match=url):
        fetch(url, REPO, "main", tmp_path / "empty", timeout=2)


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", RECORD])
def test_listing_names_that_leave_the_directory_are_refused(name: str) -> None:
    with pytest.raises(FetchError, match="leaves the model directory"):
        parse_listing({"sha": "abc", "siblings": [{"rfilename": name}]})


async def test_the_fetched_model_serves(
    start_worker: StartWorker, lm_dir: Path, tmp_path: Path
) -> None:
    dest = tmp_path / "fetched"
    with LocalHub({REPO: lm_dir}) as hub:
        proc = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "omnistage_worker.fetch", "--hub", hub.url, "--repo", REPO,
             "--dest", str(dest)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "downloaded" in proc.stdout
    worker = await start_worker(dest, "ar", "transformers")
    await worker.server.wait_loaded()
    answer = await worker.generate(prompt="hello", max_new_tokens=4)
    assert answer.WhichOneof("output") == "text"


def test_cli_error_is_one_line_with_status_2(tmp_path: Path) -> None:
    with LocalHub({}) as hub:
        proc = subprocess.run(
            [sys.executable, "-m", "omnistage_worker.fetch", "--hub", hub.url, "--repo", "no/such",
             "--dest", str(tmp_path / "d")],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("omnistage fetch: ") and "HTTP 404" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
