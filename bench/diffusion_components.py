"""GPU benchmark of component-level sleep and the sequential mode on a Flux-like pipeline.

Run on the lent GPU machine (diffusers carried as a wheel; see bench/results/README.md):

    python bench/diffusion_components.py --out $OUT/diffusion_components.json

In ONE run it measures the copy limits (pinned host-to-device and device-to-host with the
engine's own exact-size page-locked host memory), builds a Flux-like pipeline from configs with
random bf16 weights on the GPU (T5-XXL-like and CLIP-L-like encoders, a Flux transformer with
half of FLUX.1's blocks, FLUX.1's VAE: about 21 GiB, ``bench/flux_like.py``), hands its
components to the worker's :class:`ComponentEngine`, then measures:

- per component (and the two encoders together): level-1 sleep and wake over several cycles,
  against the limits, and the device memory that stays resident while it sleeps;
- the image after every wake against the image before any sleep (bit-identical);
- the sequential mode (one component resident at a time inside a request, swapped with the
  pinned host copies): peak device memory and seconds per request against all-resident.

``--smoke`` runs the same code at a tiny size on CPU (to test the script itself).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image" / "src"))
sys.path.insert(0, str(REPO))

from bench.flux_like import FULL, TINY, flux_like  # noqa: E402
from bench.reporting import emit  # noqa: E402
from omnistage_worker.engine.components import ComponentEngine  # noqa: E402
from omnistage_worker.engine.host_memory import HostBuffer  # noqa: E402

GiB = 1024**3
MiB = 1024**2
Json = dict[str, Any]
ENCODERS = ("text_encoder", "text_encoder_2")


def cuda() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if cuda():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def copy_limits(size: int, device: torch.device) -> Json:
    """Best of 5 pinned copies each way, with the engine's host memory."""
    host = HostBuffer(size, pin=cuda())
    target = torch.empty(size, dtype=torch.uint8, device=device)
    h2d = [timed(lambda: target.copy_(host.tensor, non_blocking=True)) for _ in range(5)]
    d2h = [timed(lambda: host.tensor.copy_(target, non_blocking=True)) for _ in range(5)]
    host.release()
    return {
        "bytes": size,
        "h2d_pinned_gbps": gbps(size, min(h2d)),
        "d2h_pinned_gbps": gbps(size, min(d2h)),
    }


class Request:
    """One seeded text-to-image request at a fixed size."""

    def __init__(self, pipe: Any, side: int, steps: int, seq: int) -> None:
        self.pipe, self.side, self.steps, self.seq = pipe, side, steps, seq

    def __call__(self) -> torch.Tensor:
        with torch.inference_mode():
            out = self.pipe(
                "a bird can fly over the tree",
                height=self.side,
                width=self.side,
                num_inference_steps=self.steps,
                max_sequence_length=self.seq,
                guidance_scale=3.5,
                output_type="pt",
                generator=torch.Generator(device="cpu").manual_seed(7),
            )
        images: torch.Tensor = out.images
        return images.cpu()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical values (NaN where the other has NaN counts as equal: random weights)."""
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True))


def allocated() -> int:
    return torch.cuda.memory_allocated() if cuda() else 0


def measure_requests(run: Request, engine: ComponentEngine, n: int) -> Json:
    """Seconds per request and peak device memory (allocator peak; weights resident peak)."""
    resident: list[int] = [engine.device_bytes()]
    use = engine.use

    def tracking(group: str) -> None:
        use(group)
        resident.append(engine.device_bytes())

    engine.use = tracking  # type: ignore[method-assign]
    if cuda():
        torch.cuda.reset_peak_memory_stats()
    seconds: list[float] = []
    image = torch.empty(0)
    try:
        for _ in range(n):
            start = time.perf_counter()
            image = run()
            sync()
            seconds.append(time.perf_counter() - start)
    finally:
        del engine.use
    resident.append(engine.device_bytes())
    return {
        "seconds": seconds,
        "seconds_median": statistics.median(seconds),
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda() else None,
        "peak_resident_weights_bytes": max(resident),
        "image": image,
    }


def component_cycles(
    engine: ComponentEngine, names: tuple[str, ...], cycles: int, run: Request, ref: torch.Tensor
) -> Json:
    groups = engine.resolve(names)
    nbytes = sum(engine.engines[g].flat_bytes for g in groups)
    sleeps, wakes, resident, identical = [], [], [], []
    for _ in range(cycles):
        sleeps.append(timed(lambda: engine.sleep_components(names, 1)))
        resident.append(allocated() if cuda() else engine.device_bytes())
        time.sleep(0.2 if cuda() else 0.0)
        wakes.append(timed(lambda: engine.wake_components(names)))
        identical.append(same(run(), ref))
    return {
        "components": list(names),
        "bytes": nbytes,
        "sleep_seconds": sleeps,
        "wake_seconds": wakes,
        "sleep_seconds_median": statistics.median(sleeps),
        "wake_seconds_median": statistics.median(wakes),
        "resident_while_asleep_bytes": min(resident),
        "bit_identical_after_every_wake": all(identical),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny pipeline on CPU")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--side", type=int, default=0, help="image side (default 1024; smoke 32)")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    device = torch.device("cuda:0" if cuda() and not args.smoke else "cpu")
    size = TINY if args.smoke else FULL
    side = args.side or (32 if args.smoke else 1024)
    seq = 16 if args.smoke else 512
    report: Json = {
        "machine": {
            "gpu": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.now(UTC).isoformat(),
            "smoke": args.smoke,
        },
        "request": {"side": side, "steps": args.steps, "max_sequence_length": seq},
    }
    report["limits"] = copy_limits((2 * GiB) if device.type == "cuda" else 8 * MiB, device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tokenizers:
        pipe = flux_like(size, Path(tokenizers), device=str(device), dtype=dtype)
    components = {n: m for n, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    engine = ComponentEngine(components, device)
    engine.activate()
    report["build_seconds"] = time.perf_counter() - started
    report["components"] = {
        name: {"bytes": e.flat_bytes, "gib": e.flat_bytes / GiB}
        for name, e in engine.engines.items()
    }
    report["weights_gib"] = engine.weights_bytes / GiB
    run = Request(pipe, side, args.steps, seq)
    # warm-up: kernels, the background-pinned host copies, one sleep/wake of everything
    run()
    engine.sleep(1)
    engine.wake()
    resident = measure_requests(run, engine, args.requests)
    ref = resident.pop("image")
    report["all_resident"] = resident
    report["per_component"] = {
        "+".join(names): component_cycles(engine, names, args.cycles, run, ref)
        for names in [(n,) for n in engine.names] + [ENCODERS]
    }
    engine.set_sequential(True)
    run()  # warm-up of the swaps
    sequential = measure_requests(run, engine, args.requests)
    report["sequential"] = {
        **{k: v for k, v in sequential.items() if k != "image"},
        "bit_identical": same(sequential["image"], ref),
    }
    report["image_finite"] = bool(torch.isfinite(ref).all())
    engine.set_sequential(False)
    report["summary"] = summarize(report)
    engine.close()
    emit(report, args.out)


def summarize(report: Json) -> Json:
    lim = report["limits"]
    per: Json = {}
    for name, c in report["per_component"].items():
        sleep_rate = gbps(c["bytes"], c["sleep_seconds_median"])
        wake_rate = gbps(c["bytes"], c["wake_seconds_median"])
        per[name] = {
            "gib": c["bytes"] / GiB,
            "sleep_seconds_median": c["sleep_seconds_median"],
            "wake_seconds_median": c["wake_seconds_median"],
            "sleep_ratio_to_d2h": sleep_rate / lim["d2h_pinned_gbps"],
            "wake_ratio_to_h2d": wake_rate / lim["h2d_pinned_gbps"],
            "resident_while_asleep_gib": c["resident_while_asleep_bytes"] / GiB,
            "bit_identical": c["bit_identical_after_every_wake"],
        }
    resident, seq = report["all_resident"], report["sequential"]

    def peak(r: Json) -> int:
        return int(r["peak_allocated_bytes"] or r["peak_resident_weights_bytes"])

    return {
        "per_component": per,
        "all_resident_peak_gib": peak(resident) / GiB,
        "sequential_peak_gib": peak(seq) / GiB,
        "sequential_peak_weights_gib": seq["peak_resident_weights_bytes"] / GiB,
        "largest_component_gib": max(c["gib"] for c in report["components"].values()),
        "all_resident_seconds_per_request": resident["seconds_median"],
        "sequential_seconds_per_request": seq["seconds_median"],
        "sequential_time_ratio": seq["seconds_median"] / resident["seconds_median"],
        "all_bit_identical": seq["bit_identical"] and all(p["bit_identical"] for p in per.values()),
    }


if __name__ == "__main__":
    main()
