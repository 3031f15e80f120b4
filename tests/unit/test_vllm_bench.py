"""bench/vllm_stage.py's pieces that need no GPU: the model's size and names, and the README row
its result renders to (the run itself is checked with ``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.report_vllm import vllm_section
from bench.vllm_stage_models import LLM_CONFIG, llama_shapes

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_model_is_at_least_8_gib_in_bf16() -> None:
    shapes = llama_shapes(LLM_CONFIG)
    params = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    assert params * 2 >= 8 * 1024**3
    assert "lm_head.weight" in shapes and "model.layers.23.mlp.down_proj.weight" in shapes


def test_smoke_run_renders_a_readme_section(tmp_path: Path) -> None:
    """The whole bench on CPU with the stand-in engine, then its README rows."""
    out = tmp_path / "vllm_stage.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_stage.py"), "--smoke",
         "--workdir", str(tmp_path / "w"), "--out", str(out), "--l1-cycles", "1",
         "--l2-cycles", "1", "--l1-rested-cycles", "1", "--rest-s", "0.2", "--prewarmed", "1"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["all_acks_ok"] and s["all_tokens_identical"] and s["deepen_refused"]
    assert s["all_refused_while_asleep"] and s["residual_within_bound"]
    assert s["restart_tokens_identical"] and s["cold_start_caches_kept_seconds"] > 0
    assert len(data["restarts"]) == 1  # the stage started again, its compile caches kept
    (pre,) = data["prewarmed"]  # then pre-warmed: nothing held asleep, its wake starts it
    assert pre["asleep_level"] == 2 and pre["worker_used_bytes_asleep"] == 0
    assert s["prewarmed_held_bytes_max"] <= 0 and s["prewarmed_all_acks_ok"]
    assert s["prewarmed_tokens_identical"] and pre["wake_seconds"] > 0
    assert pre["wake_seconds"] <= s["prewarmed_wake_to_first_token_seconds"]
    rested = [c for c in data["cycles"] if c["rest_s"]]
    assert [(c["level"], c["rest_s"]) for c in rested] == [(1, 0.2)]
    assert s["l1_rested_rest_s"] == 0.2 and s["l1_rested_wake_ratio_to_h2d"] > 0
    assert s["l1_rested_wake_seconds_median"] == rested[0]["wake"]["worker_seconds"]
    text = "\n".join(vllm_section(data))
    assert "A vLLM stage" in text and "hand-over vLLM -> torch" in text


def test_phase_lines_are_read_from_the_worker_log_and_summarised(tmp_path: Path) -> None:
    """The fast sleep/wake's log lines (issue 23), as vLLM's logger writes them, reach the
    bench's cycles whole (a line being written is left for the next take) and its summary."""
    from bench.vllm_stage_summary import engine_phases
    from bench.vllm_stage_workers import PhaseLog
    from omnistage_worker.runners.vllm_wake import MARKER

    def line(kind: str, total: float, sync: float) -> str:
        body = {"kind": kind, "total_seconds": total, "copy_bytes": 10**9,
                "seconds": {"sync": sync, "copies_issued": total - sync}}  # fmt: skip
        return (
            f"(EngineCore pid=7) INFO 11-28 21:00:00 [vllm_wake.py:99] {MARKER} {json.dumps(body)}"
        )

    log = tmp_path / "vllm.log"
    log.write_text("worker start\n" + line("sleep", 0.2, 0.1) + "\n" + line("wake", 0.05, 0.04))
    phases = PhaseLog(log)
    assert [p["kind"] for p in phases.take()] == ["sleep"]  # the wake's line is not whole yet
    with log.open("a") as f:
        f.write("\nother\n")
    assert [p["kind"] for p in phases.take()] == ["wake"] and phases.take() == []

    rows = [
        {"sleep_phases": [json.loads(line("sleep", s, s / 2).split(MARKER)[1])],
         "wake_phases": [json.loads(line("wake", w, w / 2).split(MARKER)[1])]}
        for s, w in ((0.2, 0.05), (0.1, 0.025), (0.3, 0.1))
    ]  # fmt: skip
    out = engine_phases(rows, {"h2d_pinned_gbps": 50.0, "d2h_pinned_gbps": 40.0})
    assert out["fast_wake"] and out["l1_wake_engine_seconds_median"] == 0.05
    assert out["l1_wake_engine_ratio_to_h2d"] == 0.4  # 20 GB/s of 50
    assert out["l1_sleep_engine_ratio_to_d2h"] == 0.125  # 5 GB/s of 40
    assert out["l1_wake_phases_median"]["sync"] == 0.025
    assert engine_phases([{"sleep_phases": [], "wake_phases": []}], {}) == {"fast_wake": False}


def test_the_readme_row_of_the_fast_path_appears_only_with_its_figures() -> None:
    data = json.loads((ROOT / "bench" / "results" / "vllm_stage.json").read_text())
    assert not any("inside the engine" in line for line in vllm_section(data))
    data["summary"].update({
        "fast_wake": True, "l1_sleep_engine_seconds_median": 0.2,
        "l1_sleep_engine_ratio_to_d2h": 0.8, "l1_wake_engine_seconds_median": 0.18,
        "l1_wake_engine_ratio_to_h2d": 0.91,
    })  # fmt: skip
    (row,) = [line for line in vllm_section(data) if "inside the engine" in line]
    assert "0.180 s (91% of H2D)" in row and "0.200 s (80% of D2H)" in row
