"""GPU benchmark of the worker's sleep engine against the host's measured copy limits.

Run on the lent GPU machine (see bench/results/worker_sleep.md for the exact command):

    python bench/worker_sleep.py --workdir /tmp/osbench --out $OUT/worker_sleep.json

In ONE run it measures the limits (pinned host-to-device and device-to-host copy bandwidth with the
same exact-size registered host memory the engine uses, pageable copies, pinning cost, the CUDA
context size from NVML, a plain safetensors ``load_file(device="cuda")``), builds realistic models
from configs with random bf16 weights and saves them as safetensors (a causal LM of >= 16 GiB and a
diffusers transformer of >= 8 GiB), then, for each model in a fresh process that loads it like the
worker does, measures level-1 sleep, level-1 wake and level-2 wake over several cycles, the NVML
process memory left after each sleep, bit-exactness of the output after every wake, and a cold
start (new process to first output). ``--tiny`` runs the same code on tiny models on CPU, to test
the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image" / "src"))
sys.path.insert(0, str(REPO))

from bench.reporting import emit  # noqa: E402
from bench.sleep_limits import child_limits, device, gbps, nvml_process_bytes, sync, timed  # noqa: E402
from bench.sleep_models import child_baseline, child_build, load_model  # noqa: E402
from omnistage_worker.engine import WeightEngine  # noqa: E402

GiB = 1024**3
MiB = 1024**2
Json = dict[str, Any]


def child_cycles(kind: str, model_dir: Path, l1_cycles: int, l2_cycles: int, gap: float) -> Json:
    """Sleep/wake cycles of one model in a fresh process, as the worker runs them."""
    dev = device()
    torch.zeros(1, device=dev)
    sync()
    context = nvml_process_bytes()
    start = time.perf_counter()
    model, forward = load_model(kind, model_dir)
    load_seconds = time.perf_counter() - start
    files = {"model": sorted(model_dir.glob("*.safetensors"))}
    engine = WeightEngine({"model": model}, dev, files)
    activate = engine.activate()
    reference = forward().cpu()  # kept off the device: it would count as residual
    sync()
    active_used = nvml_process_bytes()
    pin_wait = timed(engine._take_host)  # the background pinning, normally hidden by serving time
    result: Json = {
        "model": kind,
        "weights_bytes": engine.weights_bytes,
        "flat_bytes": engine.flat_bytes,
        "file_backed_bytes": engine.file_backed_bytes,
        "cuda_context_bytes": context,
        "load_seconds": load_seconds,
        "activate_seconds": activate.seconds,
        "active_used_bytes": active_used,
        "pin_wait_after_activate_seconds": pin_wait,
        "cycles": [],
    }
    plan = [(1, 0.0)] * l1_cycles + [(1, gap)] * 2 + [(2, 0.0)] * l2_cycles + [(2, gap)] * 2
    for i, (level, pause) in enumerate(plan):
        before = nvml_process_bytes()
        slept = engine.sleep(level)
        residual = nvml_process_bytes()
        allocator = torch.cuda.memory_reserved() if dev.type == "cuda" else 0
        time.sleep(pause)
        woke = engine.wake()
        after = forward().cpu()
        sync()
        result["cycles"].append(
            {
                "cycle": i,
                "level": level,
                "pause_before_wake_seconds": pause,
                "allocator_reserved_after_sleep_bytes": allocator,
                "sleep_seconds": slept.seconds,
                "sleep_bytes": slept.bytes_moved,
                "sleep_gbps": gbps(slept.bytes_moved, slept.seconds),
                "used_before_sleep_bytes": before,
                "residual_after_sleep_bytes": residual,
                "wake_seconds": woke.seconds,
                "wake_bytes": woke.bytes_moved,
                "wake_gbps": gbps(woke.bytes_moved, woke.seconds),
                "bit_identical": bool(torch.equal(after, reference)),
            }
        )
        print(json.dumps(result["cycles"][-1]), file=sys.stderr, flush=True)
    engine.close()
    return result


def child_cold(kind: str, model_dir: Path) -> Json:
    """Cold start: this process's own start to its first output (the parent adds spawn time)."""
    dev = device()
    model, forward = load_model(kind, model_dir)
    engine = WeightEngine({"model": model}, dev, {"model": sorted(model_dir.glob("*.safetensors"))})
    engine.activate()
    forward()
    sync()
    return {"first_output_at": time.time()}


def run_child(args: list[str], timeout: float) -> Json:
    cmd = [sys.executable, __file__, "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed with {proc.returncode}")
    data: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def summarize(limits: Json, base: dict[str, Json], cycles: dict[str, Json]) -> Json:
    """Ratios against the limits measured in this run, and the targets of issue 2."""
    out: Json = {}
    slack = 128 * MiB
    for kind, res in cycles.items():
        l1 = [c for c in res["cycles"] if c["level"] == 1]
        later = [c for c in l1 if c["pause_before_wake_seconds"] == 0][1:]  # second cycle on
        paused = [c for c in l1 if c["pause_before_wake_seconds"] > 0]
        l2 = [c for c in res["cycles"] if c["level"] == 2]
        l2_now = [c for c in l2 if c["pause_before_wake_seconds"] == 0]
        l2_paused = [c for c in l2 if c["pause_before_wake_seconds"] > 0]
        ctx = res["cuda_context_bytes"] or limits.get("cuda_context_bytes") or 0
        residuals = [c["residual_after_sleep_bytes"] for c in res["cycles"]]
        s: Json = {
            "weights_gib": res["weights_bytes"] / GiB,
            "l1_sleep_gbps_median": statistics.median(c["sleep_gbps"] for c in later),
            "l1_wake_gbps_median": statistics.median(c["wake_gbps"] for c in later),
            "l1_wake_after_pause_gbps_median": statistics.median(c["wake_gbps"] for c in paused),
            "l1_wake_after_pause_seconds_median": statistics.median(
                c["wake_seconds"] for c in paused
            ),
            "l1_sleep_seconds_median": statistics.median(c["sleep_seconds"] for c in later),
            "l1_wake_seconds_median": statistics.median(c["wake_seconds"] for c in later),
            "l2_wake_seconds_median": statistics.median(c["wake_seconds"] for c in l2_now),
            "l2_wake_after_pause_seconds_median": statistics.median(
                c["wake_seconds"] for c in l2_paused
            ),
            "plain_load_seconds": base[kind]["seconds"],
            "max_residual_bytes": max((r for r in residuals if r is not None), default=None),
            "residual_bound_bytes": ctx + slack,
            "all_bit_identical": all(c["bit_identical"] for c in res["cycles"]),
        }
        s["l1_sleep_ratio_to_d2h"] = s["l1_sleep_gbps_median"] / limits["d2h_pinned_gbps"]
        s["l1_wake_ratio_to_h2d"] = s["l1_wake_gbps_median"] / limits["h2d_pinned_gbps"]
        s["l1_wake_ratio_to_h2d_just_freed"] = (
            s["l1_wake_gbps_median"] / limits["h2d_pinned_into_just_freed_gbps"]
        )
        s["l1_wake_after_pause_ratio_to_h2d"] = (
            s["l1_wake_after_pause_gbps_median"] / limits["h2d_pinned_gbps"]
        )
        s["l2_speedup_vs_plain_load"] = s["plain_load_seconds"] / s["l2_wake_seconds_median"]
        s["l2_after_pause_speedup_vs_plain_load"] = (
            s["plain_load_seconds"] / s["l2_wake_after_pause_seconds_median"]
        )
        s["targets"] = {
            "l1_sleep_ge_90pct_d2h": s["l1_sleep_ratio_to_d2h"] >= 0.9,
            "l1_wake_ge_90pct_h2d": s["l1_wake_ratio_to_h2d"] >= 0.9,
            "l1_wake_ge_90pct_h2d_same_condition": s["l1_wake_ratio_to_h2d_just_freed"] >= 0.9,
            "l1_wake_after_pause_ge_90pct_h2d": s["l1_wake_after_pause_ratio_to_h2d"] >= 0.9,
            "l2_wake_ge_1.5x_plain_load": s["l2_speedup_vs_plain_load"] >= 1.5,
            "l2_wake_after_pause_ge_1.5x_plain_load": s["l2_after_pause_speedup_vs_plain_load"]
            >= 1.5,
            "residual_le_context_plus_128MiB": s["max_residual_bytes"] is not None
            and s["max_residual_bytes"] <= s["residual_bound_bytes"],
            "bit_identical": s["all_bit_identical"],
        }
        out[kind] = s
    return out


def machine() -> Json:
    info: Json = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            import pynvml

            pynvml.nvmlInit()
            info["driver"] = pynvml.nvmlSystemGetDriverVersion()
        except Exception as exc:  # NVML missing only weakens the record
            info["driver"] = f"unknown ({exc})"
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/omnistage-bench"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--tiny", action="store_true", help="tiny models (tests the script on CPU)")
    parser.add_argument("--l1-cycles", type=int, default=4)
    parser.add_argument("--l2-cycles", type=int, default=2)
    parser.add_argument("--models", default="llm,dit")
    parser.add_argument(
        "--pause", type=float, default=1.0, help="idle seconds before the paused wakes"
    )
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, *rest = args.child
        if what == "limits":
            result = child_limits(int(rest[0]))
        elif what == "build":
            result = child_build(Path(rest[0]), rest[1] == "tiny")
        elif what == "baseline":
            result = child_baseline(Path(rest[0]))
        elif what == "cycles":
            result = child_cycles(
                rest[0], Path(rest[1]), int(rest[2]), int(rest[3]), float(rest[4])
            )
        elif what == "cold":
            result = child_cold(rest[0], Path(rest[1]))
        else:
            raise SystemExit(f"unknown child {what}")
        print(json.dumps(result))
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    kinds = [k for k in args.models.split(",") if k]
    report: Json = {"machine": machine(), "command": " ".join(sys.argv)}
    limit_size = 64 * MiB if args.tiny else 4 * GiB
    report["limits"] = run_child(["limits", str(limit_size)], 600)
    print("limits", json.dumps(report["limits"]), flush=True)
    report["build"] = run_child(["build", str(args.workdir), "tiny" if args.tiny else "full"], 1200)
    print("build", json.dumps(report["build"]), flush=True)
    base = {k: run_child(["baseline", str(args.workdir / k)], 600) for k in kinds}
    report["plain_load"] = base
    print("plain_load", json.dumps(base), flush=True)
    cycles: dict[str, Json] = {}
    for kind in kinds:
        cycles[kind] = run_child(
            [
                "cycles",
                kind,
                str(args.workdir / kind),
                str(args.l1_cycles),
                str(args.l2_cycles),
                str(args.pause),
            ],
            1200,
        )
    report["cycles"] = cycles
    spawn = time.time()
    cold = run_child(["cold", "llm", str(args.workdir / "llm")], 600)
    report["cold_start_seconds_llm"] = cold["first_output_at"] - spawn
    report["summary"] = summarize(report["limits"], base, cycles)
    emit(report, args.out)


if __name__ == "__main__":
    main()
