"""The figures ``bench/gpu_e2e.py`` reports from its hand-overs and the NVML sampler's file:
patch-to-Active and the operator's share, the stages' peak together against the room, and each
sleep ACK against the sampler's reading just after it."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from bench.gpu_e2e_analysis import (
    ack_agreement,
    device_shares,
    peak_together,
    percentile,
    read_samples,
    sampler_periods,
)

Json = dict[str, Any]


def summarize(
    runs: list[Json], sampler_file: Path | None, room: Json | None, args: argparse.Namespace
) -> Json:
    """The figures the issue asks for, from the runs and the sampler's file."""
    total = [r["total_s"] for r in runs]
    operator = [r["operator_s"] for r in runs]
    worker = [r["worker_s"] for r in runs]
    kubectl = [r["kubectl_s"] for r in runs]

    def ms(values: list[float]) -> Json:
        if not values:
            return {}
        return {"p50": round(percentile(values, 0.5) * 1000, 1),
                "p95": round(percentile(values, 0.95) * 1000, 1),
                "max": round(max(values) * 1000, 1)}  # fmt: skip

    out: Json = {
        "switches": len(runs),
        "all_acks_ok": bool(runs) and all(r["acks_ok"] for r in runs),
        "patch_to_active_ms": ms(total),
        "operator_ms": ms(operator),
        "workers_ms": ms(worker),
        "kubectl_ms": ms(kubectl),
    }
    for key in ("operator_from_answer", "operator_from_patch"):
        shares = [r[f"{key}_s"] for r in runs if f"{key}_s" in r]
        if shares and len(shares) == len(runs):
            out[f"{key}_ms"] = ms(shares)
    if sampler_file is None or not sampler_file.exists():
        return out
    samples, cmdlines = read_samples(sampler_file)
    stages = {"llm": str(args.work / "models" / "llm"), "sd": str(args.work / "models" / "sd")}
    pids = {s: {pid for pid, cmd in cmdlines.items() if f"{path} " in cmd + " "}
            for s, path in stages.items()}  # fmt: skip
    # the hand-overs: from the first patch to the last switch's Active (+1 s)
    window = (
        (runs[0]["wall_start"], runs[-1]["wall_start"] + runs[-1]["total_s"] + 1.0)
        if runs
        else (0.0, 0.0)
    )
    during = [x for x in samples if window[0] <= x.t <= window[1]]
    out["sampler"] = {
        "samples": len(samples),
        "target_period_ms": args.period * 1000,
        "period_ms": _period_ms(sampler_periods(samples)),
        "samples_during_handovers": len(during),
        "period_ms_during_handovers": _period_ms(sampler_periods(during)),
        "pids": {s: sorted(p) for s, p in pids.items()},
    }
    peak = peak_together(samples, [pids["llm"], pids["sd"]])
    out["peak_together_bytes"] = peak
    device_peak = max(device_shares(samples, pids["llm"] | pids["sd"]), default=0)
    out["device_peak_bytes"] = device_peak  # the memory charged to no process counted too
    if room:
        out["peak_below_room"] = peak <= room["room_bytes"]
        out["device_peak_below_room"] = device_peak <= room["room_bytes"]
    sleeps = [
        {"stage": r["loser"], "time": r["sleep"].get("time"),
         "used_after_bytes": r["sleep"].get("usedAfterBytes")}
        for r in runs if r["sleep"]
    ]  # fmt: skip
    checks = ack_agreement(samples, pids, sleeps)
    out["sleep_ack_vs_sampler"] = checks
    out["sleep_acks_agree"] = bool(checks) and all(c["within"] for c in checks)
    return out


def _period_ms(periods: list[float]) -> Json:
    if not periods:
        return {}
    return {
        "p50": round(percentile(periods, 0.5) * 1000, 2),
        "p99": round(percentile(periods, 0.99) * 1000, 2),
        "max": round(max(periods) * 1000, 2),
    }
