"""Two stages of ``gpus: 2`` on a 2-GPU host: per-device sleep and wake, hand-overs, exact outputs.

Run on the lent ``nvidia-h200-x2`` (see bench/results/README.md for the exact command):

    python bench/multi_gpu.py --work /tmp/multigpu --out $OUT/multi_gpu.json

What it does, in order, all through the real ``omnistage-worker`` processes over gRPC:

1. Copy limits, measured in this run, in a child process: page-locked host<->device copies of
   ``--limit-gib`` per device, H2D and D2H, each device alone and both devices at once (one
   thread per device, as the worker's engine copies; ``bench/copy_limits.py``).
2. Two causal LMs of ``--gib`` each (Llama-shaped, random bf16 weights, different seeds), saved
   as safetensors; each is a stage with ``--gpus 2``: its worker splits it over cuda:0 and
   cuda:1 (device map of whole decoder layers, one flat buffer per device).
3. Stage A starts active, stage B starts asleep at level 1 (page-locked host copy only).
4. "Cannot both fit" is arranged honestly with a ballast tenant: a separate process takes, on
   each device, all the free memory NVML shows with A awake and B asleep, less ``--room-gib``
   (default: half of B's per-device weights, so B cannot wake beside A and fits only once A's
   share is freed). Both stages together would need both shares on each device; the ballast and the
   figures before and after are recorded. Without it the weights would have to exceed
   2 x 140 GiB per stage, which neither the host RAM (pinned copies) nor the disk can hold.
   A wake of B while A is awake is then tried: it must fail (CUDA OOM on a device), answer
   ``ok=false`` and leave B asleep.
5. ``--handovers`` hand-overs A -> B -> A (level 1), then one level-2 cycle of A: every ACK's
   per-device figures (used before/after, freed, free before/after) checked against NVML read
   from outside for the worker's pid, each transition's rate per device against the limits,
   and the tokens after every wake against the stage's reference (A: before its first sleep;
   B: after its first wake, since it starts asleep).

``--smoke`` runs the same script on CPU with a tiny model and two simulated devices per stage
(``--device cpu --gpus 2``: separate buffers and accounting per device; no copy limits, no
ballast, no NVML), to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.copy_limits import child_limits  # noqa: E402
from bench.multi_gpu_acks import (  # noqa: E402
    DEVICES,
    Nvml,
    per_device_rates,
    stage_bytes,
    transition,
    wait_asleep,
)
from bench.multi_gpu_children import child_ballast, child_build  # noqa: E402
from bench.reporting import emit  # noqa: E402
from bench.worker_grpc import INFERENCE, SLEEP, generate, start_worker  # noqa: E402
from omnistage.worker.v1 import sleep_service_pb2  # noqa: E402

Json = dict[str, Any]
GiB = 1024**3
MiB = 1024**2


def log(msg: str) -> None:
    print(f"[multi_gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_child(args: list[str], timeout: float) -> Json:
    proc = subprocess.run(
        [sys.executable, __file__, *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    result: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def run(args: argparse.Namespace) -> Json:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    report: Json = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "smoke": smoke,
        "stage_gib": None if smoke else args.gib,
    }
    if not smoke:
        import torch

        report["machine"] = {
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
        }
        log("copy limits")
        report["limits"] = run_child(["--child", "limits", str(args.limit_gib)], 600)
    models = {}
    for name, seed in (("a", 1), ("b", 2)):
        path = work / f"model-{name}"
        log(f"building model {name}")
        report[f"build_{name}"] = run_child(
            ["--child", "build", str(path), str(args.gib), str(seed), "1" if smoke else "0"], 1800
        )
        models[name] = path
    nvml = None if smoke else Nvml()
    extra = ["--gpus=2"] + (["--cpu-threads=1"] if smoke else [])
    log("starting stage a (active) and stage b (asleep at level 1)")
    a = start_worker(
        models["a"], device, ["--initial-state=active", *extra], work / "a.log", INFERENCE
    )
    b = start_worker(
        models["b"],
        device,
        ["--initial-state=asleep", "--sleep-level=1", *extra],
        work / "b.log",
        SLEEP,
    )
    ballast: subprocess.Popen[str] | None = None
    try:
        report["b_started"] = wait_asleep(b)
        status = a.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)
        report["a_devices"] = [
            {"device": d.device, "uuid": d.uuid, "used_bytes": d.used_after_bytes}
            for d in status.devices
        ]
        reference_a = generate(a)
        if nvml is not None:
            a_used = [d["used_bytes"] for d in report["a_devices"]]
            ballast, report["ballast"] = arrange_ballast(nvml, a_used, args)
            report["b_wake_while_a_awake"] = transition(b, "wake", 0, nvml)
            report["b_after_refused_wake"] = wait_asleep(b)
        cycles = []
        reference_b: list[int] | None = None
        for i in range(args.handovers):
            cycle: Json = {"i": i}
            cycle["a_sleep"] = transition(a, "sleep", 1, nvml)
            cycle["b_wake"] = transition(b, "wake", 0, nvml)
            tokens = generate(b)
            reference_b = reference_b or tokens
            cycle["b_tokens_identical"] = tokens == reference_b
            cycle["b_sleep"] = transition(b, "sleep", 1, nvml)
            cycle["a_wake"] = transition(a, "wake", 0, nvml)
            cycle["a_tokens_identical"] = generate(a) == reference_a
            cycles.append(cycle)
            log(json.dumps({k: v for k, v in cycle.items() if "tokens" in k or k == "i"}))
        report["handovers"] = cycles
        level2: Json = {"a_sleep": transition(a, "sleep", 2, nvml)}
        level2["a_wake"] = transition(a, "wake", 0, nvml)
        level2["a_tokens_identical"] = generate(a) == reference_a
        report["level2"] = level2
    finally:
        if ballast is not None:
            assert ballast.stdin is not None
            ballast.stdin.close()
            ballast.wait(60)
        a.stop()
        b.stop()
    report["summary"] = summarize(report)
    return report


def arrange_ballast(nvml: Nvml, a_used: list[int], args: argparse.Namespace) -> tuple[Any, Json]:
    """A tenant that leaves ``room`` free per device: B fits only once A's share is freed.
    ``a_used``: what A's worker measured on each device (NVML, its own process)."""
    b_per_device = [int(args.gib * GiB / DEVICES)] * DEVICES
    # Half of B's share stays free: B cannot wake beside A, and fits once A's share is freed.
    room = [int(args.room_gib * GiB) if args.room_gib else b // 2 for b in b_per_device]
    free = nvml.free()
    sizes = [max(0, f - r) for f, r in zip(free, room, strict=True)]
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", "ballast", *map(str, sizes)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
        raise RuntimeError("the ballast tenant did not start")
    after = nvml.free()
    info = {
        "ballast_bytes": sizes,
        "nvml_processes_with_ballast": [sorted(p.values()) for p in nvml.processes()],
        "free_before_bytes": free,
        "free_with_ballast_bytes": after,
        "a_used_bytes": a_used,
        "b_needs_per_device_bytes": b_per_device,
        "both_fit": all(f >= b for f, b in zip(after, b_per_device, strict=True)),
        "b_fits_once_a_sleeps": all(
            f + u >= b for f, u, b in zip(after, a_used, b_per_device, strict=True)
        ),
    }
    log(f"ballast: {json.dumps(info)}")
    return proc, info


def summarize(report: Json) -> Json:
    cycles = report["handovers"]
    transitions = [t for c in cycles for k, t in c.items() if isinstance(t, dict)]
    transitions += [report["level2"]["a_sleep"], report["level2"]["a_wake"]]
    out: Json = {
        "handovers": len(cycles),
        "all_acks_ok": all(t["ok"] for t in transitions),
        "all_tokens_identical": all(
            c["a_tokens_identical"] and c["b_tokens_identical"] for c in cycles
        )
        and report["level2"]["a_tokens_identical"],
        "every_ack_lists_both_devices": all(len(t["devices"]) == DEVICES for t in transitions),
        "every_device_freed_on_sleep": all(
            d["freed_bytes"] > 0 for t in transitions if t["op"] == "sleep" for d in t["devices"]
        ),
    }
    steady = cycles[1:] or cycles
    shares = {stage: stage_bytes(cycles, stage) for stage in ("a", "b")}
    out["per_device_share_bytes"] = shares
    for key in ("a_sleep", "a_wake", "b_sleep", "b_wake"):
        seconds = sorted(c[key]["worker_seconds"] for c in steady)
        rates = [per_device_rates(c[key], shares[key[0]]) for c in steady]
        out[f"{key}_seconds_median"] = seconds[len(seconds) // 2]
        out[f"{key}_per_device_gbps_median"] = [
            sorted(r[i] for r in rates)[len(rates) // 2] for i in range(DEVICES)
        ]
    out["level2_wake_seconds"] = report["level2"]["a_wake"]["worker_seconds"]
    limits = report.get("limits")
    if limits:
        pairs = (("a_sleep", "d2h"), ("a_wake", "h2d"), ("b_sleep", "d2h"), ("b_wake", "h2d"))
        for key, direction in pairs:
            out[f"{key}_fraction_of_together_limit"] = [
                round(rate / limits[f"{direction}_together_gbps_cuda{i}"], 3)
                for i, rate in enumerate(out[f"{key}_per_device_gbps_median"])
            ]
        diffs = [
            min(abs(d["used_after_bytes"] - n) for n in procs or [0])
            for t in transitions
            if "nvml_processes_after" in t
            for d, procs in zip(t["devices"], t["nvml_processes_after"], strict=True)
        ]
        out["ack_vs_outside_nvml_max_diff_mib"] = max(diffs) / MiB if diffs else None
    if "ballast" in report:
        refused = report["b_wake_while_a_awake"]
        out["both_fit_with_ballast"] = report["ballast"]["both_fit"]
        out["b_wake_while_a_awake_refused"] = not refused["ok"]
        out["b_asleep_after_refused_wake"] = report["b_after_refused_wake"]["state"]
    return out


def use_bundle(bundle: Path, work: Path) -> None:
    """The packages the host lacks (grpc health/reflection...), from gpu_bundle's site archive."""
    from bench.gpu_e2e_host import extract_xz

    site = work / "site"
    if not (site / ".installed").is_file():
        manifest = json.loads((bundle / "manifest.json").read_text())
        extract_xz(bundle / manifest["site"], site)
        (site / ".installed").write_text("")
    sys.path.insert(0, str(site))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def child_main(argv: list[str]) -> None:
    kind = argv[0]
    if kind == "limits":
        print(json.dumps(child_limits(float(argv[1]))))
    elif kind == "build":
        print(json.dumps(child_build(Path(argv[1]), float(argv[2]), int(argv[3]), argv[4] == "1")))
    elif kind == "ballast":
        child_ballast([int(x) for x in argv[1:]])
    else:
        raise SystemExit(f"unknown child {kind}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/multigpu"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gib", type=float, default=16.0, help="weights per stage (GiB)")
    parser.add_argument("--limit-gib", type=float, default=4.0, help="copy-limit buffer per device")
    parser.add_argument(
        "--room-gib", type=float, default=0.0, help="free memory the ballast leaves per device"
    )
    parser.add_argument(
        "--bundle", type=Path, help="a bench.gpu_bundle folder: its packages (site.tar.xz) used"
    )
    parser.add_argument("--handovers", type=int, default=4)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, simulated devices")
    args = parser.parse_args()
    if args.smoke:
        args.handovers = min(args.handovers, 2)
    if not math.isfinite(args.gib) or args.gib <= 0:
        parser.error("--gib must be positive")
    if args.bundle is not None:
        use_bundle(args.bundle, args.work)
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
