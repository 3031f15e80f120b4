"""bench/pipeline_host.py: disk sizing, the room check of the sampler's file, resumed runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench.pipeline_host import RunStore, room_check, size_for_disk, weight_bytes
from bench.qwen_image_like import TINY

BASE = dataclasses.replace(TINY, dit_layers=30)


def test_size_for_disk_keeps_every_block_when_the_disk_holds_them() -> None:
    encoder, block, rest = weight_bytes(BASE)
    free = 3 * 2**30 + encoder + rest + 30 * block
    size, info = size_for_disk(free, BASE)
    assert size.dit_layers == 30 and not info["shrunk_for_disk"]
    assert info["expected_dit_bytes"] == rest + 30 * block


def test_size_for_disk_drops_blocks_the_disk_cannot_hold() -> None:
    encoder, block, rest = weight_bytes(BASE)
    free = 3 * 2**30 + encoder + rest + 25 * block + block // 2
    size, info = size_for_disk(free, BASE)
    assert size.dit_layers == 25 and info["shrunk_for_disk"]
    with pytest.raises(SystemExit, match="DiT blocks"):
        size_for_disk(3 * 2**30 + encoder + rest + 5 * block, BASE)


def test_room_check_leaves_the_ballast_out(tmp_path: Path) -> None:
    samples = tmp_path / "s"
    samples.write_text(
        "P 7 python3 bench/gpu_e2e.py ballast 100 /tmp/r\n"
        "P 8 omnistage-worker --port 1\n"
        "S 10.0 50 150 7:100 8:40\n"
        "S 11.0 30 170 7:100 8:40 9:25\n"
        "S 12.0 0 200 7:100 8:95 9:5\n"  # after the window
    )
    inside = room_check(samples, 70, 9.5, 11.5)
    assert inside["peak_stages_bytes"] == 65 and inside["within_room"]
    assert inside["samples"] == 2 and inside["min_free_bytes"] == 30
    assert not room_check(samples, 70, 9.5, 12.5)["within_room"]  # 95 + 5 > 70
    assert "within_room" not in room_check(samples, None, 0, 20)


def test_run_store_resumes_only_the_same_setting(tmp_path: Path) -> None:
    store = RunStore(tmp_path, {"steps": 10})
    store.add({"run": "resident", "images_per_s": 1.0})
    store.add({"run": "resident", "images_per_s": 2.0})
    assert RunStore(tmp_path, {"steps": 10}).done("resident") == {
        "run": "resident",
        "images_per_s": 2.0,
    }
    assert RunStore(tmp_path, {"steps": 20}).done("resident") is None
