"""bench/multi_gpu_probe.py on CPU (``--dry-run``): every variant runs and copies the right
bytes, and its summary gives each hypothesis its ratios (the GPU run is the lead's)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.multi_gpu_probe import run
from bench.multi_gpu_probe_host import PATTERN_BLOCK, pattern_fill, pattern_ok
from bench.multi_gpu_probe_report import ENGINE_CHECK, HEADLINE, HYPOTHESES, VARIANTS, summarize


def test_the_pattern_shows_a_block_copied_to_the_wrong_place() -> None:
    buffer = torch.empty(6 * PATTERN_BLOCK, dtype=torch.uint8)
    pattern_fill(buffer, salt=1)
    assert pattern_ok(buffer, salt=1, slab_blocks=4) and not pattern_ok(buffer, salt=2)
    swapped = buffer.clone()
    swapped[:PATTERN_BLOCK] = buffer[PATTERN_BLOCK : 2 * PATTERN_BLOCK]
    assert not pattern_ok(swapped, salt=1, slab_blocks=4)


def rounds(seconds: list[list[float]], **extra: Any) -> list[list[dict[str, Any]]]:
    return [[{"seconds": s, **extra} for s in per_device] for per_device in seconds]


def test_summary_rates_each_variant_against_both_limits() -> None:
    gb = 10**9
    report = {
        "bytes_per_device": 50 * gb,
        "multi_gpu_limit": {"h2d_together_gbps_cuda0": 50.0, "h2d_together_gbps_cuda1": 40.0},
        "variants": {
            "limit": {"rounds": rounds([[1.0, 1.25], [2.0, 2.5]])},  # best 50 / 40 GB/s
            "peer_free_one": {"rounds": rounds([[2.0, 2.5], [2.0, 2.5], [4.0, 5.0]])},
            "warm_one_numa": {"skipped": "one NUMA node online ([0])"},
        },
    }
    summary = summarize(report)
    assert summary["inprocess_limit_best_gbps"] == [50.0, 40.0]
    peer = summary["variants"]["peer_free_one"]
    assert peer["gbps_median"] == [25.0, 20.0] and peer["of_multi_gpu_limit"] == [0.5, 0.5]
    assert summary["variants"]["warm_one_numa"] == {"skipped": "one NUMA node online ([0])"}
    assert summary["evidence"]["postfree"]["peer_free_one / limit"] == [0.667, 0.667]
    assert summary["evidence"]["numa"]["warm_one_numa / limit"] is None


def dry_run(**options: Any) -> dict[str, Any]:
    args = argparse.Namespace(
        dry_run=True,
        gib=8.0,
        limit_gib=4.0,
        repeats=1,
        settle=0.0,
        budget_s=600.0,
        out=None,
        skip="",
        only="",
        engine_check=False,
    )
    for key, value in options.items():
        setattr(args, key, value)
    report: dict[str, Any] = run(args)
    return report


def test_a_dry_run_runs_every_variant_with_the_right_bytes() -> None:
    report = dry_run()
    assert set(report["variants"]) == {v.name for v in VARIANTS}
    for name, result in report["variants"].items():
        assert "error" not in result, (name, result)
        assert len(result["rounds"]) == 1 and len(result["rounds"][0]) == 2, name
    summary = report["summary"]
    assert summary["all_bytes_ok"]
    assert set(summary["evidence"]) == {h["id"] for h in HYPOTHESES}
    for name in ("engine_settled_threads", "engine_settled_gil_busy_no_switch"):
        engine = report["variants"][name]["rounds"][0]
        assert all(d["bytes"] > 0 and d["bytes_ok"] for d in engine), name
    numa = report["variants"]["warm_one_numa"]["host_facts"]
    assert all("bind" in f and "page_nodes" in f for f in numa)  # placed on node 0, read back


def test_the_engine_check_runs_its_variants_only() -> None:
    report = dry_run(engine_check=True)
    assert list(report["variants"]) == ENGINE_CHECK
    assert all("error" not in r for r in report["variants"].values())
    assert report["summary"]["all_bytes_ok"]
    assert set(HEADLINE) <= set(ENGINE_CHECK)
    assert dry_run(only="limit,engine_settled")["variants"].keys() == {"limit", "engine_settled"}
