"""Overlapped hand-over on one GPU (issue 23's moonshot): two real workers, the outgoing one's
sleep streamed (``SleepStream``) while the incoming one wakes under a claim limit raised by
each measured release (``bench/overlap_relay.py``), against serial hand-overs in the same run.

Run on the lent GPU host (see bench/results/README.md for the exact command):

    python bench/overlap.py --work /tmp/overlap --out $OUT/overlap.json

In order:

1. Copy limits in a child process: page-locked H2D and D2H of ``--limit-gib`` alone, and both
   directions at once on two streams (what an overlapped hand-over can reach at best).
2. Two Llama-shaped causal LMs of ``--gib`` each (random bf16 weights, different seeds).
3. Stage A starts Active, stage B asleep at level 1; a ballast tenant takes all the free memory
   but ``--slack-gib``, so B cannot wake beside A: the room is A's use awake, B's asleep and
   the slack. An NVML sampler (``gpu_e2e_children.child_sampler``) reads both workers' memory
   from outside every ``--sample-ms`` for the whole run.
4. ``--serial`` serial hand-overs (Sleep, then WakeUp) and ``--handovers`` overlapped ones, A->B
   and B->A in turn; every ``--tokens-every`` hand-overs the woken stage's greedy tokens are
   compared with its reference.

The summary: hand-over seconds (median) per mode against the serial copy bound (bytes/D2H +
bytes/H2D, the limits above); the overlapped bound (bytes over the slower direction while both
run); every Ack ok; tokens identical; the sampler's peak of the two stages together against the
room, and how many samples exceeded it (the promise: none).

``--smoke`` runs the same script on CPU with tiny models (no limits, ballast or sampler), to
test the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.gpu_e2e_analysis import read_samples  # noqa: E402
from bench.overlap_relay import overlapped, room_check, serial  # noqa: E402
from bench.reporting import emit  # noqa: E402
from bench.worker_grpc import INFERENCE, SLEEP, Worker, generate, start_worker  # noqa: E402
from omnistage.worker.v1 import sleep_service_pb2, types_pb2  # noqa: E402
from omnistage_worker.engine.handoff import HANDOFF_DIR_ENV  # noqa: E402
from omnistage_worker.engine.vmm import piece_bytes  # noqa: E402

Json = dict[str, Any]
GiB = 1024**3
MiB = 1024**2
BALLAST_CONTEXT = 640 * MiB
"""The ballast process's own CUDA context, about this much on the H200 (bench/gpu_e2e.py)."""


def log(msg: str) -> None:
    print(f"[overlap {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run_child(args: list[str], timeout: float) -> Json:
    proc = subprocess.run(
        [sys.executable, __file__, "--child", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed:\n{proc.stderr[-4000:]}")
    result: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def child_limits(gib: float) -> Json:
    """H2D and D2H GB/s alone, and each while the other runs on its own stream."""
    import torch

    from omnistage_worker.engine.host_memory import HostBuffer

    size = int(gib * GiB)
    hosts = [HostBuffer(size, pin=True).tensor for _ in range(2)]
    gpus = [torch.empty(size, dtype=torch.uint8, device="cuda:0") for _ in range(2)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]  # type: ignore[no-untyped-call]

    def timed(h2d: bool, d2h: bool) -> tuple[float, float]:
        torch.cuda.synchronize()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]  # type: ignore[no-untyped-call]
        if h2d:
            with torch.cuda.stream(streams[0]):
                events[0].record()
                gpus[0].copy_(hosts[0], non_blocking=True)
                events[1].record()
        if d2h:
            with torch.cuda.stream(streams[1]):
                events[2].record()
                hosts[1].copy_(gpus[1], non_blocking=True)
                events[3].record()
        torch.cuda.synchronize()
        up = events[0].elapsed_time(events[1]) / 1e3 if h2d else 0.0
        down = events[2].elapsed_time(events[3]) / 1e3 if d2h else 0.0
        return up, down

    h2d = min(timed(True, False)[0] for _ in range(4))
    d2h = min(timed(False, True)[1] for _ in range(4))
    both = [timed(True, True) for _ in range(4)]
    return {
        "buffer_bytes": size,
        "h2d_gbps": size / h2d / 1e9,
        "d2h_gbps": size / d2h / 1e9,
        "h2d_while_d2h_gbps": size / min(u for u, _ in both) / 1e9,
        "d2h_while_h2d_gbps": size / min(d for _, d in both) / 1e9,
    }


def start_sampler(work: Path, period_ms: float) -> subprocess.Popen[bytes]:
    out = work / "sampler.txt"
    proc = subprocess.Popen(
        [
            sys.executable,
            str(REPO / "bench/gpu_e2e.py"),
            "sampler",
            str(out),
            str(period_ms / 1000.0),
            "0",
        ]
    )
    deadline = time.monotonic() + 60
    while not (out.exists() and out.stat().st_size > 0):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the NVML sampler did not start")
        time.sleep(0.05)
    return proc


def start_ballast(nbytes: int, work: Path) -> subprocess.Popen[bytes]:
    ready = work / "ballast.ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "bench/gpu_e2e.py"), "ballast", str(nbytes), str(ready)]
    )
    deadline = time.monotonic() + 120
    while not ready.exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the ballast tenant did not start")
        time.sleep(0.05)
    return proc


def status(worker: Worker) -> sleep_service_pb2.GetStatusResponse:
    reply: sleep_service_pb2.GetStatusResponse = worker.sleep.GetStatus(
        sleep_service_pb2.GetStatusRequest(), timeout=30
    )
    return reply


def run(args: argparse.Namespace) -> Json:
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    report: Json = {
        "benchmark": "overlap",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code": os.environ.get("OMNISTAGE_COMMIT", ""),
        "smoke": smoke,
        "stage_gib": None if smoke else args.gib,
        "piece_mib": piece_bytes() >> 20,
    }
    if not smoke:
        import torch

        report["machine"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
        log("copy limits")
        report["limits"] = run_child(["limits", str(args.limit_gib)], 600)
    models = {}
    for name, seed in (("a", 1), ("b", 2)):
        models[name] = work / f"model-{name}"
        log(f"building model {name}")
        report[f"build_{name}"] = run_child(
            ["build", str(models[name]), str(args.gib), str(seed), "1" if smoke else "0"], 1800
        )
    extra = ["--cpu-threads=1"] if smoke else []
    if args.handoff:  # the workers inherit the environment
        (work / "handoff").mkdir(parents=True, exist_ok=True)
        os.environ[HANDOFF_DIR_ENV] = str(work / "handoff")
    report["handoff"] = args.handoff
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
    helpers: list[subprocess.Popen[bytes]] = []
    try:
        deadline = time.monotonic() + 300
        while status(b).state != types_pb2.WORKER_STATE_ASLEEP:
            if time.monotonic() > deadline:
                raise TimeoutError("stage b did not start asleep")
            time.sleep(0.05)
        references = {"a": generate(a)}
        room = 0
        if not smoke:
            a_used, b_used = status(a).used_bytes, status(b).used_bytes
            free = status(a).free_bytes
            slack = int(args.slack_gib * GiB)
            helpers.append(start_ballast(max(0, free - slack - BALLAST_CONTEXT), work))
            room = a_used + b_used + status(a).free_bytes
            report["room"] = {"a_used": a_used, "b_used": b_used, "free_before": free,
                              "slack": slack, "room_bytes": room}  # fmt: skip
            helpers.append(start_sampler(work, args.sample_ms))
        report["handovers"] = handovers(a, b, args, references)
    finally:
        for proc in helpers:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        a.stop()
        b.stop()
    if not smoke:
        samples, _ = read_samples(work / "sampler.txt")
        report["sampler"] = room_check(samples, (a.proc.pid, b.proc.pid), room)
    report["handoff_logs"] = handoff_counts([work / "a.log", work / "b.log"])
    report["summary"] = summarize(report)
    return report


def handovers(
    a: Worker, b: Worker, args: argparse.Namespace, references: dict[str, list[int]]
) -> list[Json]:
    """``--serial`` serial then ``--handovers`` overlapped hand-overs, A->B and B->A in turn."""
    stages = {"a": a, "b": b}
    awake = "a"
    done: list[Json] = []
    plan = ["serial"] * args.serial + ["overlapped"] * args.handovers
    for i, mode in enumerate(plan):
        asleep = "b" if awake == "a" else "a"
        out, inc = stages[awake], stages[asleep]
        result = (
            serial(out, inc)
            if mode == "serial"
            else overlapped(out, inc, int(args.margin_mib * MiB), handoff=args.handoff)
        )
        result["to"] = asleep
        if i % args.tokens_every == 0 or i == len(plan) - 1:
            tokens = generate(inc)
            references.setdefault(asleep, tokens)
            result["tokens_identical"] = tokens == references[asleep]
        done.append(result)
        if not (result["sleep"]["ok"] and result["wake"]["ok"]):
            log(f"hand-over {i} failed: {json.dumps(result)}")
            break
        if i < 4 or i % 50 == 0:
            log(f"{i} {mode} -> {asleep}: {result['seconds']:.4f} s")
        awake = asleep
    return done


HANDED = re.compile(r"hand-off \S+: (\d+) pieces \((\d+) bytes\) (handed over|taken over), (\d+)")


def handoff_counts(logs: list[Path]) -> Json:
    """The workers' hand-off lines summed: pieces and bytes handed over by the sleeps (and
    freed instead), taken over by the wakes (and freed unused)."""
    out = dict.fromkeys(("sent_pieces", "sent_bytes", "unsent_pieces", "taken_pieces",
                         "taken_bytes", "dropped_pieces"), 0)  # fmt: skip
    for path in logs:
        for found in HANDED.finditer(path.read_text(errors="replace") if path.exists() else ""):
            pieces, nbytes, what, other = found.groups()
            side, left = ("sent", "unsent") if what == "handed over" else ("taken", "dropped")
            out[f"{side}_pieces"] += int(pieces)
            out[f"{side}_bytes"] += int(nbytes)
            out[f"{left}_pieces"] += int(other)
    return out


def summarize(report: Json) -> Json:
    runs = report["handovers"]
    out: Json = {
        "handovers": len(runs),
        "all_acks_ok": all(r["sleep"]["ok"] and r["wake"]["ok"] for r in runs),
        "all_tokens_identical": all(r.get("tokens_identical", True) for r in runs),
    }
    moved = statistics.median(r["wake"]["bytes_moved"] for r in runs) if runs else 0
    out["bytes_moved"] = moved
    for mode in ("serial", "overlapped"):
        seconds = [r["seconds"] for r in runs if r["mode"] == mode]
        out[f"{mode}_count"] = len(seconds)
        out[f"{mode}_seconds_median"] = statistics.median(seconds) if seconds else None
    limits = report.get("limits")
    if limits and moved:
        bound = moved / (limits["d2h_gbps"] * 1e9) + moved / (limits["h2d_gbps"] * 1e9)
        both = max(
            moved / (limits["h2d_while_d2h_gbps"] * 1e9),
            moved / (limits["d2h_while_h2d_gbps"] * 1e9),
        )
        out["serial_bound_s"] = bound
        out["overlapped_physical_bound_s"] = both
        for mode in ("serial", "overlapped"):
            median = out[f"{mode}_seconds_median"]
            out[f"{mode}_over_serial_bound"] = median / bound if median else None
    if "sampler" in report:
        out["within_room"] = report["sampler"]["within_room"]
        out["samples_over_room"] = report["sampler"]["samples_over_room"]
        out["device_samples_over_room"] = report["sampler"].get("device_samples_over_room")
    out["handoff"] = report.get("handoff", False)
    out["handoff_taken_bytes"] = report.get("handoff_logs", {}).get("taken_bytes", 0)
    return out


def child_main(argv: list[str]) -> None:
    from bench.multi_gpu_children import child_build

    kind = argv[0]
    if kind == "limits":
        print(json.dumps(child_limits(float(argv[1]))))
    elif kind == "build":
        print(json.dumps(child_build(Path(argv[1]), float(argv[2]), int(argv[3]), argv[4] == "1")))
    else:
        raise SystemExit(f"unknown child {kind}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child_main(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/overlap"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--gib", type=float, default=16.0, help="weights per stage (GiB)")
    parser.add_argument("--limit-gib", type=float, default=4.0, help="copy-limit buffer")
    parser.add_argument(
        "--slack-gib", type=float, default=1.0, help="free memory the ballast leaves"
    )
    parser.add_argument(
        "--margin-mib", type=float, default=256.0, help="free memory the first limit leaves"
    )
    parser.add_argument("--serial", type=int, default=6, help="serial hand-overs")
    parser.add_argument("--handovers", type=int, default=20, help="overlapped hand-overs")
    parser.add_argument("--tokens-every", type=int, default=1)
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models, no limits")
    parser.add_argument(
        "--handoff",
        action="store_true",
        help="overlapped hand-overs hand the device pieces over (both workers get a hand-off "
        "directory under --work)",
    )
    args = parser.parse_args()
    if args.smoke:
        args.gib = 0.0
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
