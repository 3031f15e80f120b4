"""The floor of a vLLM stage's level-1 wake on its own layout, measured in the same run.

A level-1 wake maps every allocation of the engine anew (its weights and its KV cache) and copies
the weights back; on an H200 whose KV cache is 109.5 GiB, mapping that memory slows the copies
beside it, and right after the sleep the driver is still cleaning what the sleep released
(``scrub_probe.json``). ``bench/vllm_wake_probe.py`` makes the same driver calls without vLLM,
over the layout the stage's own sleep reported (its weight allocations and bytes, its KV
allocations), in the wake's order: what it takes is what any wake of that layout takes on this
machine. ``bench/vllm_stage.py`` runs it once the stage has stopped, and its summary gives each
wake against that floor beside the copy limit.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

Json = dict[str, Any]
REPO = Path(__file__).resolve().parents[1]


def layout_of(report: Json) -> Json | None:
    """The engine's allocations from its first fast level-1 sleep's phases (the copies are its
    weights, the rest of what it released its KV cache); None if no cycle logged one (pure)."""
    for cycle in report.get("cycles", []):
        if cycle["level"] != 1 or not cycle.get("sleep_phases"):
            continue
        p = cycle["sleep_phases"][-1]
        kv_allocs = p["releases"] - p["copies"]
        if kv_allocs <= 0:
            return None
        kv_bytes = p["total_bytes"] - p["copy_bytes"]
        return {
            "weight_allocs": p["copies"], "weight_bytes": p["copy_bytes"],
            "kv_allocs": kv_allocs, "kv_alloc_bytes": kv_bytes // kv_allocs,
        }  # fmt: skip
    return None


def probe_command(layout: Json, model: Json, rest_s: float, out: Path) -> list[str]:
    """The probe's command line for ``layout`` and the stage's Llama config ``model`` (pure)."""
    shape = [model["num_hidden_layers"], model["hidden_size"], model["intermediate_size"]]
    return [
        sys.executable, "-m", "bench.vllm_wake_probe",
        "--model", ",".join(str(n) for n in [*shape, model["vocab_size"]]),
        "--weight-allocs", str(layout["weight_allocs"]),
        "--weight-bytes", str(layout["weight_bytes"]),
        "--kv-allocs", str(layout["kv_allocs"]),
        "--kv-gib", repr(layout["kv_alloc_bytes"] / (1 << 30)),
        "--host", "registered", "--ways", "ce,ce_premapped", "--when", "rested,right_after",
        "--repeats", "3", "--rest-s", str(rest_s), "--out", str(out),
    ]  # fmt: skip


def measure(report: Json, model: Json, rest_s: float, work: Path) -> Json:
    """Run the probe over the report's layout (the stage stopped: the device is free); its
    report, or why it did not run."""
    layout = layout_of(report)
    if layout is None:
        return {"error": "no fast level-1 sleep logged its phases"}
    out = work / "wake_floor.json"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "worker_image/src"), str(REPO), env.get("PYTHONPATH")) if p
    )
    cmd = probe_command(layout, model, rest_s, out)
    done = subprocess.run(
        cmd, check=False, cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0 or not out.exists():
        return {"error": f"probe exited {done.returncode}: {done.stderr[-2000:]}", "layout": layout}
    return {"layout": layout, **json.loads(out.read_text())}


def summary(report: Json, s: Json) -> Json:
    """The stage's level-1 wakes (ACK and engine, right after the sleep and rested; the stage's
    summary ``s``) against the floor of the same wake without vLLM, each ``floor / measured``
    (1.0: at the floor), and the floors' own share of H2D (pure)."""
    floor = report.get("wake_floor") or {}
    wakes = floor.get("wakes")
    if not wakes:
        return {}
    med = {k: statistics.median(v["seconds"]) for k, v in wakes.items()}
    out: Json = {
        "l1_wake_floor_seconds": med.get("right_after/ce"),
        "l1_rested_wake_floor_seconds": med.get("rested/ce"),
        "l1_copy_floor_seconds": med.get("rested/ce_premapped"),
    }
    copy_s = floor["weight_bytes"] / floor["limits"]["h2d_ce_gbps"] / 1e9
    for key in ("l1_wake_floor_seconds", "l1_rested_wake_floor_seconds"):
        if out[key]:
            out[key.replace("seconds", "of_h2d")] = copy_s / out[key]
    for rest in ("", "rested_"):  # l1_wake_of_floor, l1_wake_engine_of_floor, l1_rested_...
        floor_s = out[f"l1_{rest}wake_floor_seconds"]
        for engine in ("", "engine_"):
            measured = s.get(f"l1_{rest}wake_{engine}seconds_median")
            if floor_s and measured:
                out[f"l1_{rest}wake_{engine}of_floor"] = floor_s / measured
    return out
