"""bench/coldstart.py's reading of the worker log and its summary (pure logic)."""

from __future__ import annotations

import pytest

from bench.coldstart import parse_log, summarize

LOG = """\
2026-11-26 09:18:56,668 INFO omnistage_worker.startup: startup: flags parsed at +0.120s \
(unix 1000.500000)
2026-11-26 09:18:58,546 INFO omnistage_worker.startup: startup: imports done at +1.997s \
(unix 1002.250000)
2026-11-26 09:19:05,116 INFO omnistage_worker.control.loading: model activated: 17805419008 weight \
bytes, 17805419008 bytes moved in 0.72s (load total 10.90s)
2026-11-26 09:19:09,519 INFO omnistage_worker.runners.causal_lm: warm-up: 2 tokens in 1.500s
2026-11-26 09:19:09,521 INFO omnistage_worker.startup: startup: active at +12.973s \
(unix 1013.000000)
"""


def test_phases_are_seconds_after_the_spawn() -> None:
    parsed = parse_log(LOG, spawned_unix=1000.0)
    assert parsed["phases_s"] == {"flags parsed": 0.5, "imports done": 2.25, "active": 13.0}
    assert parsed["weights_bytes"] == 17805419008
    assert parsed["weights_to_device_s"] == 0.72
    assert parsed["warm_up_s"] == 1.5


def test_summary_holds_the_goal_figures_and_their_limits() -> None:
    nbytes = 20 * 10**9
    report = {
        "limits": {
            "weight_bytes": nbytes,
            "read_gbps": 40.0,
            "h2d_gbps": 50.0,
            "import_model_s": 7.0,
        },
        "warm": [
            {"first_token_s": 9.0, "tokens": [1]},
            {"first_token_s": 8.0, "tokens": [1]},
            {"first_token_s": 10.0, "tokens": [1]},
        ],
        "cold_evicted": {"first_token_s": 20.0},
        "disk_read_gbps": 2.0,
    }
    s = summarize(report)
    assert s["cold_start_first_token_s"] == 9.0
    assert s["cold_start_first_token_cold_cache_s"] == 20.0
    assert s["cold_cache_method"] == "fadvise"
    assert s["read_limit_s"] == pytest.approx(0.5)
    assert s["process_floor_s"] == pytest.approx(7.5)  # imports + the slower of read and copy
    assert s["first_token_over_process_floor"] == pytest.approx(9.0 / 7.5)
    assert s["cold_cache_over_disk_limit"] == pytest.approx(2.0)
    assert s["same_tokens"]
