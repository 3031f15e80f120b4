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
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image" / "src"))
sys.path.insert(0, str(REPO))

from bench.reporting import emit  # noqa: E402
from omnistage_worker.engine import WeightEngine  # noqa: E402
from omnistage_worker.engine.host_memory import HostBuffer  # noqa: E402

GiB = 1024**3
MiB = 1024**2
Json = dict[str, Any]


# ---- measurement helpers ---------------------------------------------------------------------


def device() -> torch.device:
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def nvml_process_bytes() -> int | None:
    """NVML's figure of this process's memory on GPU 0 (None on CPU or if NVML can't say)."""
    if not torch.cuda.is_available():
        return None
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
            return int(proc.usedGpuMemory)
    return None


def nvml_device_used() -> int | None:
    if not torch.cuda.is_available():
        return None
    import pynvml

    pynvml.nvmlInit()
    info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
    return int(info.used)


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# ---- children --------------------------------------------------------------------------------


def child_limits(size: int) -> Json:
    """Copy limits, measured with the engine's own exact-size registered host buffers."""
    dev = device()
    torch.zeros(1, device=dev)
    sync()
    context = nvml_process_bytes()
    pin = dev.type == "cuda"
    started = time.perf_counter()
    host = HostBuffer(size, pin=pin)
    pin_seconds = time.perf_counter() - started
    host.tensor.fill_(7)
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    pageable = torch.empty(size, dtype=torch.uint8)
    pageable.fill_(3)
    h2d, d2h, page = _steady_copies(host.tensor, gpu, pageable)
    del gpu, pageable
    fresh = [_fresh_copy(host, size, gap) for gap in (0.0, 0.0, 0.0, 1.0, 1.0, 1.0)]
    host.release()
    return {
        "h2d_pinned_into_just_freed_gbps": gbps(size, min(fresh[:3])),
        "h2d_pinned_into_freed_1s_ago_gbps": gbps(size, min(fresh[3:])),
        "buffer_bytes": size,
        "cuda_context_bytes": context,
        "pin_seconds_per_gib": pin_seconds / (size / GiB),
        "h2d_pinned_gbps": gbps(size, min(h2d)),
        "d2h_pinned_gbps": gbps(size, min(d2h)),
        "h2d_pageable_gbps": gbps(size, min(page)),
    }


def _steady_copies(
    host: torch.Tensor, gpu: torch.Tensor, pageable: torch.Tensor
) -> tuple[list[float], list[float], list[float]]:
    """Seconds of pinned H2D, pinned D2H and pageable H2D copies into touched device memory."""
    h2d, d2h, page = [], [], []
    for _ in range(5):
        h2d.append(timed(lambda: gpu.copy_(host, non_blocking=True)))
        d2h.append(timed(lambda: host.copy_(gpu, non_blocking=True)))
        page.append(timed(lambda: gpu.copy_(pageable)))
    return h2d, d2h, page


def _fresh_copy(host: HostBuffer, size: int, gap: float) -> float:
    """A bare allocate-and-copy into device memory freed ``gap`` seconds ago: what a wake meets.

    Right after memory goes back to the driver, copies into a new allocation run slower for about
    a second (the driver's own post-free work); the engine's wake pays the same, so its rate is
    compared with this figure taken under the same condition.
    """
    dev = device()
    scratch = torch.empty(size, dtype=torch.uint8, device=dev)
    scratch.fill_(1)
    del scratch
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    time.sleep(gap)

    def alloc_and_copy() -> None:
        torch.empty(size, dtype=torch.uint8, device=dev).copy_(host.tensor, non_blocking=True)

    seconds = timed(alloc_and_copy)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return seconds


def llm_config(tiny: bool) -> Any:
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )


def dit_kwargs(tiny: bool) -> Json:
    if tiny:
        return {
            "num_layers": 1,
            "num_single_layers": 1,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 16,
            "in_channels": 16,
            "axes_dims_rope": (4, 6, 6),
        }
    return {"num_layers": 8, "num_single_layers": 16}


def child_build(workdir: Path, tiny: bool) -> Json:
    """Random-weight bf16 models built from configs on the device, saved as safetensors."""
    from transformers import LlamaForCausalLM

    flux = _flux_class()
    dev = device()
    out: Json = {}
    torch.set_default_dtype(torch.bfloat16)
    torch.manual_seed(0)
    llm_dir = workdir / "llm"
    if not (llm_dir / "config.json").exists():
        with dev:
            model = LlamaForCausalLM(llm_config(tiny))
        start = time.perf_counter()
        model.save_pretrained(llm_dir, max_shard_size="4GB")
        out["llm_save_seconds"] = time.perf_counter() - start
        del model
    dit_dir = workdir / "dit"
    if not (dit_dir / "config.json").exists():
        with dev:
            dit = flux(**dit_kwargs(tiny))
        start = time.perf_counter()
        dit.save_pretrained(dit_dir, max_shard_size="4GB")
        out["dit_save_seconds"] = time.perf_counter() - start
        del dit
    for name, path in (("llm", llm_dir), ("dit", dit_dir)):
        files = sorted(path.glob("*.safetensors"))
        out[f"{name}_file_bytes"] = sum(f.stat().st_size for f in files)
    return out


def _flux_class() -> Any:
    """diffusers' Flux transformer class (untyped upstream)."""
    import diffusers

    return diffusers.FluxTransformer2DModel


def child_baseline(model_dir: Path) -> Json:
    """Plain ``safetensors.torch.load_file(device=...)`` of the model's files (page cache warm)."""
    from safetensors.torch import load_file

    dev = device()
    torch.zeros(1, device=dev)
    files = sorted(model_dir.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # make sure the page cache holds the files, as it does for the worker's wake
        with f.open("rb") as fh:
            while fh.read(64 * MiB):
                pass
    runs = []
    holder: list[dict[str, torch.Tensor]] = []
    for _ in range(2):
        runs.append(timed(lambda: holder.extend(load_file(f, device=str(dev)) for f in files)))
        holder.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    best = min(runs)
    return {"bytes": nbytes, "seconds": best, "gbps": gbps(nbytes, best)}


def load_model(kind: str, model_dir: Path) -> tuple[torch.nn.Module, Callable[[], torch.Tensor]]:
    """Load like the worker's runners (on CPU), and a fixed-input forward for exactness checks."""
    if kind == "llm":
        from transformers import LlamaForCausalLM

        model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
        model.train(False)
        vocab = int(model.config.vocab_size)

        def forward() -> torch.Tensor:
            ids = (torch.arange(64, device=device()).reshape(1, 64) * 7919) % vocab
            with torch.inference_mode():
                logits: torch.Tensor = model(input_ids=ids).logits.float().clone()
            return logits

        return model, forward
    dit = _flux_class().from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    dit.train(False)
    cfg = dit.config
    gen = torch.Generator().manual_seed(1)
    img, txt = 256, 32
    inputs = {
        "hidden_states": torch.randn(1, img, cfg.in_channels, generator=gen),
        "encoder_hidden_states": torch.randn(1, txt, cfg.joint_attention_dim, generator=gen),
        "pooled_projections": torch.randn(1, cfg.pooled_projection_dim, generator=gen),
        "timestep": torch.tensor([0.5]),
        "img_ids": torch.zeros(img, 3),
        "txt_ids": torch.zeros(txt, 3),
    }

    def forward_dit() -> torch.Tensor:
        args = {k: v.to(device(), torch.bfloat16) for k, v in inputs.items()}
        with torch.inference_mode():
            sample: torch.Tensor = dit(**args, return_dict=False)[0].float().clone()
        return sample

    return dit, forward_dit


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


# ---- orchestration ---------------------------------------------------------------------------


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
