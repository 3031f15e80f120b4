"""bench/vllm_wake_floor.py and the probe's layout: a vLLM stage's level-1 wake held against the
same wake without vLLM, from the committed H200 run (pure logic; the probe itself needs a GPU:
bench/results/vllm_stage.md)."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from bench import speed_figures, vllm_wake_floor
from bench.vllm_stage_models import LLM_CONFIG
from bench.vllm_stage_summary import summarize
from bench.vllm_wake_probe import weight_sizes

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _floor_run() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / "vllm_stage_h200_floor.json").read_text())
    return data


def test_the_layout_is_the_engines_own_sleep_weights_copied_and_the_kv_cache_released() -> None:
    report = _floor_run()
    sleep = next(c for c in report["cycles"] if c["level"] == 1)["sleep_phases"][-1]
    layout = vllm_wake_floor.layout_of(report)
    assert layout is not None
    assert layout["weight_allocs"] == sleep["copies"] == 103
    assert layout["weight_bytes"] == sleep["copy_bytes"]
    assert layout["kv_allocs"] == sleep["releases"] - sleep["copies"] == 26
    kv = layout["kv_allocs"] * layout["kv_alloc_bytes"]
    assert sleep["total_bytes"] - sleep["copy_bytes"] - kv < layout["kv_allocs"]
    # the probe ran over exactly that layout
    assert report["wake_floor"]["layout"] == layout
    assert report["wake_floor"]["weight_bytes"] == layout["weight_bytes"]


def test_without_a_fast_sleep_logged_there_is_no_layout_and_no_floor() -> None:
    report = _floor_run()
    for cycle in report["cycles"]:
        cycle["sleep_phases"] = []  # vLLM's own sleep: no phase lines
    assert vllm_wake_floor.layout_of(report) is None
    del report["wake_floor"]
    assert vllm_wake_floor.summary(report, report["summary"]) == {}


def test_the_probes_weights_are_the_engines_count_and_bytes() -> None:
    layout = vllm_wake_floor.layout_of(_floor_run())
    assert layout is not None
    c, allocs, total = LLM_CONFIG, layout["weight_allocs"], layout["weight_bytes"]
    sizes = weight_sizes(
        c["num_hidden_layers"], c["hidden_size"], c["intermediate_size"], c["vocab_size"],
        allocs=allocs, total=total,
    )  # fmt: skip
    assert len(sizes) == layout["weight_allocs"]
    assert sum(sizes) == layout["weight_bytes"]
    assert all(n % (2 << 20) == 0 for n in sizes)
    cmd = vllm_wake_floor.probe_command(layout, LLM_CONFIG, 3.0, Path("/tmp/floor.json"))
    assert cmd[cmd.index("--weight-bytes") + 1] == str(layout["weight_bytes"])
    assert cmd[cmd.index("--model") + 1] == "24,4096,11008,32000"


def test_each_wake_is_held_against_the_median_of_its_floor() -> None:
    report = _floor_run()
    s, floor = report["summary"], report["wake_floor"]
    right_after = statistics.median(floor["wakes"]["right_after/ce"]["seconds"])
    rested = statistics.median(floor["wakes"]["rested/ce"]["seconds"])
    out = vllm_wake_floor.summary(report, s)
    assert out["l1_wake_floor_seconds"] == right_after
    assert out["l1_wake_of_floor"] == pytest.approx(right_after / s["l1_wake_seconds_median"])
    assert out["l1_rested_wake_engine_of_floor"] == pytest.approx(
        rested / s["l1_rested_wake_engine_seconds_median"]
    )
    copy_s = floor["weight_bytes"] / floor["limits"]["h2d_ce_gbps"] / 1e9
    assert out["l1_rested_wake_floor_of_h2d"] == pytest.approx(copy_s / rested)
    # the committed summary is what the function gives
    assert {k: s[k] for k in out} == out
    # a slower wake reads further from its floor
    slower = copy.deepcopy(s)
    slower["l1_wake_seconds_median"] *= 2
    assert vllm_wake_floor.summary(report, slower)["l1_wake_of_floor"] == pytest.approx(
        out["l1_wake_of_floor"] / 2
    )


def test_the_wake_part_gives_issue_23s_key_before_the_full_vllm_part() -> None:
    wake = speed_figures.vllm_wake(_floor_run())
    prewarm = json.loads((RESULTS / "vllm_stage_h200_prewarm.json").read_text())
    full = speed_figures.vllm(prewarm)
    assert "l1_wake_floor_seconds" not in full  # measured only from 2026-11-30 on
    out = speed_figures.summary({"vllm": full, "vllm_wake": wake}, {})
    assert out["source"]["vllm_l1_wake_of_h2d"] == "vllm_wake"
    assert out["vllm_l1_wake_of_h2d"] == _floor_run()["summary"]["l1_wake_ratio_to_h2d"]
    assert (out["vllm_cold_start_s"], out["source"]["vllm_cold_start_s"]) == (
        full["vllm_cold_start_s"],
        "vllm",
    )
    assert wake["l1_wake_of_floor"] == _floor_run()["summary"]["l1_wake_of_floor"]
    alone = speed_figures.summary({"vllm": full}, {})
    assert alone["source"]["vllm_l1_wake_of_h2d"] == "vllm"


def test_the_hand_overs_give_the_wake_the_operator_orders() -> None:
    report = json.loads((RESULTS / "vllm_stage_h200_handovers.json").read_text())
    hs = report["handovers"]
    assert len(hs) == report["summary"]["handovers"] == 7 and report["handover"] == hs[0]
    wake_s = statistics.median(h["vllm_wake"]["worker_seconds"] for h in hs)
    weights, h2d = report["build"]["vllm"]["bytes"], report["limits"]["h2d_pinned_gbps"]
    # the committed summary is what the summary module gives from the report
    assert summarize(report) == report["summary"]
    s = report["summary"]
    assert s["l1_handover_wake_seconds_median"] == wake_s
    assert s["l1_handover_wake_ratio_to_h2d"] == pytest.approx(weights / wake_s / 1e9 / h2d)
    figures = speed_figures.vllm_wake(report)
    assert figures["vllm_l1_wake_of_h2d"] == s["l1_handover_wake_ratio_to_h2d"]
    assert figures["l1_wake_basis"].startswith("in a hand-over")
    assert figures["l1_right_after_sleep_wake_ratio_to_h2d"] == s["l1_wake_ratio_to_h2d"]
    # a report of one hand-over (before 2026-11-30) keeps the wake right after the sleep
    older = speed_figures.vllm_wake(_floor_run())
    assert older["l1_wake_basis"] == "right after its sleep"
    # one failed ACK in any hand-over is seen
    broken = copy.deepcopy(report)
    broken["handovers"][3]["torch_sleep"]["ok"] = False
    assert summarize(broken)["all_acks_ok"] is False
