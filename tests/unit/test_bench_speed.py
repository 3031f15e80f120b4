"""bench/speed_figures.py: issue 23's figures read from the committed reports of the benches
that bench/speed.py runs (pure logic; the CPU run itself: tests/e2e/test_bench_speed.py)."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench import speed_figures

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def _load(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / name).read_text())
    return data


def test_the_handover_is_held_against_its_own_runs_serial_copy_bound() -> None:
    report = _load("gpu_e2e.json")
    figures = speed_figures.handover(report)
    lim, models = report["limits"], report["models"]
    # every run moves one stage out and the other in: the same bytes either way round
    bound = (models["llm_weight_bytes"] + models["sd_weight_bytes"]) / (
        lim["h2d_pinned_gbps"] * 1e9
    )
    assert figures["serial_bound_p50_s"] == pytest.approx(bound, rel=0.01)
    assert figures["handover_over_serial_bound"] == pytest.approx(
        figures["patch_to_active_p50_s"] / bound, rel=0.02
    )
    # the operator's share leaves kubectl's own process out: each run's total less its workers'
    # transitions and its kubectl, at the median
    shares = [r["total_s"] - r["worker_s"] - r["kubectl_s"] for r in report["runs"]]
    assert figures["operator_p50_ms"] == pytest.approx(1000 * statistics.median(shares), abs=2)
    assert figures["operator_p50_ms"] < report["operator_ms"]["p50"]
    assert figures["operator_with_kubectl_p50_ms"] == report["operator_ms"]["p50"]
    assert figures["limits"]["d2h_pinned_gbps"] == lim["d2h_pinned_gbps"]


def _slowest_wake(summary: dict[str, Any]) -> float:
    """Either stage's slowest device, as a share of the limit both devices copying at once."""
    fractions: list[float] = [
        *summary["a_wake_fraction_of_together_limit"],
        *summary["b_wake_fraction_of_together_limit"],
    ]
    return min(fractions)


@pytest.mark.parametrize(
    ("part", "name", "key", "expected"),
    [
        ("coldstart", "coldstart.json", "cold_start_first_token_s",
         lambda s: s["cold_start_first_token_s"]),
        ("vllm", "vllm_stage.json", "vllm_cold_start_s", lambda s: s["cold_start_seconds"]),
        ("vllm", "vllm_stage.json", "vllm_l1_wake_of_h2d", lambda s: s["l1_wake_ratio_to_h2d"]),
        ("multi_gpu", "multi_gpu.json", "multi_gpu_wake_of_limit", _slowest_wake),
    ],
)  # fmt: skip
def test_each_part_gives_its_key_from_its_bench_report(
    part: str, name: str, key: str, expected: Callable[[dict[str, Any]], float]
) -> None:
    report = _load(name)
    figures = speed_figures.FIGURES[part](report)
    assert figures[key] == expected(report["summary"])
    assert figures["limits"], "the limits measured in the same run come with the figure"


def test_a_key_no_part_measured_is_none_with_the_reason() -> None:
    report = _load("vllm_stage.json")
    out = speed_figures.summary(
        {"vllm": speed_figures.vllm(report)}, {"handover": "no GPU", "operator": "exit 1"}
    )
    assert set(speed_figures.GOALS) <= set(out)
    assert out["vllm_cold_start_s"] == report["summary"]["cold_start_seconds"]
    assert out["source"] == {"vllm_l1_wake_of_h2d": "vllm", "vllm_cold_start_s": "vllm"}
    assert out["met"] == {"vllm_l1_wake_of_h2d": False, "vllm_cold_start_s": False}
    assert out["operator_p50_ms"] is None
    assert out["missing"]["operator_p50_ms"] == "handover: no GPU; operator: exit 1"
    assert out["overlapped_over_serial_bound"] is None
    assert out["missing"]["overlapped_over_serial_bound"] == "no part that measures it ran"
    assert set(out["missing"]) == {k for k in speed_figures.GOALS if out[k] is None}


def test_the_overlapped_handover_is_held_against_its_own_runs_serial_bound() -> None:
    """Recomputed from the hand-overs and limits of the committed 1000-hand-over run."""
    report = _load("overlap_h200_1000.json")
    lim = report["limits"]
    runs = [r for r in report["handovers"] if r["mode"] == "overlapped"]
    moved = statistics.median(r["wake"]["bytes_moved"] for r in runs)
    bound = moved / (lim["d2h_gbps"] * 1e9) + moved / (lim["h2d_gbps"] * 1e9)
    figures = speed_figures.overlap(report)
    assert len(runs) == figures["overlapped_count"] == 1000
    assert figures["overlapped_over_serial_bound"] == pytest.approx(
        statistics.median(r["seconds"] for r in runs) / bound, rel=1e-6
    )
    assert figures["samples_over_room"] == report["sampler"]["samples_over_room"] == 0
    out = speed_figures.summary({"overlap": figures}, {})
    assert out["source"]["overlapped_over_serial_bound"] == "overlap"
    assert out["met"]["overlapped_over_serial_bound"] is (
        figures["overlapped_over_serial_bound"] <= 0.65
    )


def test_the_gpu_handovers_operator_share_comes_before_the_local_control_planes() -> None:
    out = speed_figures.summary(
        {"handover": {"operator_p50_ms": 150.0}, "operator": {"operator_p50_ms": 90.0}}, {}
    )
    assert (out["operator_p50_ms"], out["source"]["operator_p50_ms"]) == (150.0, "handover")


def test_a_vllm_restart_with_its_caches_kept_gives_the_cold_start() -> None:
    report = _load("vllm_stage.json")
    first = report["summary"]["cold_start_seconds"]
    report["summary"]["cold_start_caches_kept_seconds"] = first / 4
    figures = speed_figures.vllm(report)
    assert figures["vllm_cold_start_s"] == first / 4
    assert figures["cold_start_basis"] == "caches kept"
    assert figures["cold_start_first_s"] == first
    assert speed_figures.vllm(_load("vllm_stage.json"))["cold_start_basis"].startswith("first")


def test_the_default_handover_is_overlapped_and_the_serial_one_has_its_own_key() -> None:
    overlapped = _load("gpu_e2e_overlapped_h200_1000.json")
    assert overlapped["overlapped_handover"] and len(overlapped["runs"]) == 1000
    default = speed_figures.handover(overlapped)
    assert default["mode"] == "overlapped"
    serial_report = _load("gpu_e2e_h200_5f31957.json")
    serial = speed_figures.handover_serial(serial_report)
    key = "serial_patch_to_active_over_serial_bound"
    assert serial["mode"] == "serial" and "handover_over_serial_bound" not in serial
    assert serial[key] == speed_figures.handover(serial_report)["handover_over_serial_bound"]
    out = speed_figures.summary({"handover": default, "handover_serial": serial}, {})
    assert out["handover_over_serial_bound"] == default["handover_over_serial_bound"]
    assert (out[key], out["source"][key]) == (serial[key], "handover_serial")
    assert out[key] > out["handover_over_serial_bound"]  # the wake beside the sleep gains
    assert out["operator_p50_ms"] == default["operator_p50_ms"]  # from the default's run


def test_overlapping_transitions_count_once_in_the_workers_share() -> None:
    from bench.gpu_e2e_cluster import workers_s

    def ack(start: str, end: str, seconds: float) -> dict[str, Any]:
        return {"startedAt": f"2026-11-29T11:28:{start}Z", "time": f"2026-11-29T11:28:{end}Z",
                "durationSeconds": seconds}  # fmt: skip

    # serial: the wake begins after the sleep ended, the two durations add up
    assert workers_s(ack("02.000", "02.300", 0.3), ack("02.350", "02.650", 0.3)) == 0.6
    # overlapped: the span from the first start to the last end
    overlapped = workers_s(ack("02.000", "02.376", 0.376), ack("02.001", "02.436", 0.435))
    assert overlapped == pytest.approx(0.436)
    # a run of the committed overlapped report: its span is below the sum of its transitions
    run = _load("gpu_e2e_overlapped_h200.json")["runs"][0]
    summed = run["sleep"]["durationSeconds"] + run["wake"]["durationSeconds"]
    assert run["worker_s"] == workers_s(run["sleep"], run["wake"]) < summed


def test_a_prewarmed_vllm_start_gives_the_cold_start_with_the_pods_own_beside_it() -> None:
    report = _load("vllm_stage.json")
    first = report["summary"]["cold_start_seconds"]
    report["summary"]["cold_start_caches_kept_seconds"] = first / 4
    report["summary"]["prewarmed_wake_to_first_token_seconds"] = first / 8
    figures = speed_figures.vllm(report)
    assert figures["vllm_cold_start_s"] == first / 8
    assert figures["cold_start_basis"] == "pre-warmed pod, wake -> first token"
    assert figures["cold_start_spawn_s"] == first / 4
