"""What ``bench/multi_gpu_probe.py`` measures and how it is read: its variants, the hypotheses
they decide, and the summary (each variant's per-device GB/s against both limits, and each
hypothesis's evidence as the ratio of two variants, per device, medians)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Variant:
    """One measurement: what it holds fixed and what it changes."""

    name: str
    tests: str
    host: str  # whole | chunks | hostalloc | numa | engine
    issue: str  # one | split (engine: its own wake)
    dest: str  # warm (allocated once, kept) | fresh (allocated inside the step)
    condition: str  # settled | own_free | peer_free | peer_free_ballast
    one_thread: bool = False  # bare copies: one thread issues both devices' (else one each)
    alone: bool = False  # the devices one after the other instead of at once
    threads: bool = False  # engine: one thread per device, each its shard's own wake
    gil_busy: bool = False
    switch: bool = True  # engine: the switch interval lowered while it copies (engine/gil.py)


def V(name: str, spec: str, tests: str, **options: Any) -> Variant:
    """A variant from ``spec``: "host issue dest condition" (see :class:`Variant`)."""
    host, issue, dest, condition = spec.split()
    return Variant(name, tests, host, issue, dest, condition, **options)


E = "engine wake fresh"
VARIANTS: list[Variant] = [  # in order of importance: a short budget drops the last ones
    V("limit", "whole one warm settled", "the limit as bench/multi_gpu.py takes it, here"),
    V("engine_peer_free", f"{E} peer_free", "the worker's wake in a hand-over (the bench's)"),
    V("engine_settled", f"{E} settled", "the worker's wake with no recent free"),
    V(
        "engine_settled_alone",
        f"{E} settled",
        "the worker's wake, one device at a time",
        alone=True,
    ),
    V(
        "engine_settled_gil_busy",
        f"{E} settled",
        "the wake beside a busy Python thread",
        gil_busy=True,
    ),
    V(
        "engine_settled_gil_busy_no_switch",
        f"{E} settled",
        "the same with the switch interval left at its default (the one-call issue alone)",
        gil_busy=True,
        switch=False,
    ),
    V(
        "engine_settled_threads",
        f"{E} settled",
        "one thread per device, each its own device's wake (the issue before)",
        threads=True,
    ),
    V("engine_peer_free_alone", f"{E} peer_free", "the same in a hand-over", alone=True),
    V("engine_own_free", f"{E} own_free", "the worker's wake right after its own sleep"),
    V(
        "warm_one_thread",
        "whole one warm settled",
        "one thread issues both devices' copies",
        one_thread=True,
    ),
    V("peer_free_one", "whole one fresh peer_free", "bare allocate+copy after a peer's free"),
    V("settled_fresh_one", "whole one fresh settled", "the allocation in the step, no free"),
    V("own_free_one", "whole one fresh own_free", "allocate+copy after this process's free"),
    V("warm_split_whole", "whole split warm settled", "64 MiB pieces instead of one copy"),
    V(
        "warm_split_chunks",
        "chunks split warm settled",
        "the engine's host copy (64 MiB registrations)",
    ),
    V("settled_fresh_split_chunks", "chunks split fresh settled", "the engine's copy, bare"),
    V("peer_free_split_chunks", "chunks split fresh peer_free", "the same in a hand-over"),
    V(
        "peer_free_ballast_one",
        "whole one fresh peer_free_ballast",
        "hand-over where the new allocation must reuse the freed memory",
    ),
    V("engine_peer_free_ballast", f"{E} peer_free_ballast", "the bench's hand-over exactly"),
    V(
        "peer_free_one_alone",
        "whole one fresh peer_free",
        "bare copy after a peer's free, one device at a time",
        alone=True,
    ),
    V("warm_one_hostalloc", "hostalloc one warm settled", "cudaHostAlloc, not HostRegister"),
    V("warm_one_numa", "numa one warm settled", "host pages on the GPU's NUMA node"),
]

ENGINE_CHECK = [
    "limit",
    "engine_peer_free",
    "engine_settled",
    "engine_settled_alone",
    "engine_settled_gil_busy",
    "engine_settled_gil_busy_no_switch",
    "engine_settled_threads",
    "engine_peer_free_alone",
    "engine_own_free",
    "warm_one_thread",
]
"""``--engine-check``: the engine's wake against the same limits, in about 2 minutes."""


HYPOTHESES: list[Json] = [
    {
        "id": "one_thread",
        "claim": "the engine's wake issued from one thread (every device's pieces interleaved, "
        "in one call) runs both devices at the rate of one device alone",
        "compare": ["engine_settled", "engine_settled_alone"],
        "also": [
            ["engine_peer_free", "engine_peer_free_alone"],
            ["engine_settled", "engine_settled_threads"],
            ["engine_settled", "warm_one_thread"],
        ],
        "confirmed_if": "engine_settled/engine_settled_alone at or above 0.97 (0.90 with one "
        "thread per device, code db31bba), and engine_settled/engine_settled_threads above 1",
    },
    {
        "id": "gil",
        "claim": "a busy Python thread no longer slows the wake: one call issues the pieces, "
        "and the switch interval is lowered while the transition runs",
        "compare": ["engine_settled_gil_busy", "engine_settled"],
        "also": [["engine_settled_gil_busy_no_switch", "engine_settled"]],
        "confirmed_if": "engine_settled_gil_busy/engine_settled at or above 0.95 (0.028 at code "
        "db31bba); the no_switch ratio says how much of it the one call alone gives",
    },
    {
        "id": "postfree",
        "claim": "a wake right after another process freed memory (the hand-over) copies slower: "
        "the driver's post-free work",
        "compare": ["peer_free_one", "limit"],
        "also": [["settled_fresh_one", "limit"], ["own_free_one", "limit"]],
        "confirmed_if": "peer_free_one/limit well under 1 (about 0.88, as on one GPU) while "
        "settled_fresh_one/limit is near 1",
    },
    {
        "id": "reuse",
        "claim": "the bench's ballast makes the new allocation reuse the memory just freed, "
        "which costs more than fresh memory",
        "compare": ["peer_free_ballast_one", "peer_free_one"],
        "also": [["engine_peer_free_ballast", "engine_peer_free"]],
        "confirmed_if": "ratio under 0.97",
    },
    {
        "id": "allocation",
        "claim": "allocating the destination inside the wake costs time",
        "compare": ["settled_fresh_one", "limit"],
        "also": [],
        "confirmed_if": "ratio under 0.97, and its alloc_ms a visible share of its seconds",
    },
    {
        "id": "pieces",
        "claim": "64 MiB pieces copy slower than one copy",
        "compare": ["warm_split_whole", "limit"],
        "also": [],
        "confirmed_if": "ratio under 0.97",
    },
    {
        "id": "registrations",
        "claim": "the engine's host copy (one registration per 64 MiB) copies slower than one "
        "registration",
        "compare": ["warm_split_chunks", "warm_split_whole"],
        "also": [],
        "confirmed_if": "ratio under 0.97",
    },
    {
        "id": "engine",
        "claim": "the engine adds time of its own (views, Python) to the bare copy",
        "compare": ["engine_settled", "settled_fresh_split_chunks"],
        "also": [["engine_peer_free", "peer_free_split_chunks"]],
        "confirmed_if": "ratio under 0.97",
    },
    {
        "id": "hostalloc",
        "claim": "cudaHostAlloc'd host memory copies faster than cuMemHostRegister'd",
        "compare": ["warm_one_hostalloc", "limit"],
        "also": [],
        "confirmed_if": "ratio above 1.03",
    },
    {
        "id": "numa",
        "claim": "host pages on the GPU's own NUMA node copy faster",
        "compare": ["warm_one_numa", "limit"],
        "also": [],
        "confirmed_if": "ratio above 1.03 (skipped where one node is online: nothing to place)",
    },
    {
        "id": "limit_method",
        "claim": "the limit is measured another way than the wakes (4 GiB, best of 4, kept "
        "destination, in a fresh process) and reads higher than a median at this size",
        "compare": ["limit", "multi_gpu_limit"],
        "also": [],
        "confirmed_if": "limit's median/multi_gpu_limit under 0.97",
    },
    {
        "id": "ack",
        "claim": "the bench divides by the Ack's seconds, which hold more than the engine's "
        "wake (two NVML readings, state changes, the gRPC transition frame)",
        "compare": [],
        "also": [],
        "confirmed_if": "engine_peer_free's of_multi_gpu_limit well above the bench's 0.74-0.76"
        " (ack_reads gives the two readings' share)",
    },
]

HEADLINE = ["engine_peer_free", "engine_settled", "engine_settled_alone", "engine_settled_gil_busy"]
"""The summary's ``headline``: each one's per-device share of ``multi_gpu_limit``."""


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def variant_figures(result: Json, size: int, limits: list[float], inprocess: list[float]) -> Json:
    """Per device: GB/s (median, best, on the GPU's clock), allocation, the ratios to limits."""
    rounds: list[list[Json]] = result.get("rounds") or []
    if not rounds:
        return {k: result[k] for k in ("skipped", "error") if k in result}
    devices = len(rounds[0])
    out: Json = {"gbps_median": [], "gbps_best": [], "alloc_ms_median": [], "bytes_ok": True}
    gpu: list[float] = []
    for i in range(devices):
        per = [r[i] for r in rounds]
        rates = [p.get("bytes", size) / p["seconds"] / 1e9 for p in per]
        out["gbps_median"].append(_median(rates))
        out["gbps_best"].append(max(rates))
        out["alloc_ms_median"].append(_median([p.get("alloc_s", 0.0) * 1e3 for p in per]))
        if all("gpu_s" in p for p in per):
            gpu.append(_median([p.get("bytes", size) / p["gpu_s"] / 1e9 for p in per]))
        if "wall_s" in per[0]:
            walls = [p.get("bytes", size) / p["wall_s"] / 1e9 for p in per]
            out.setdefault("wall_gbps_median", []).append(_median(walls))
        sleeps = [p["sleep_before"] for p in per if p.get("sleep_before")]
        if sleeps:  # the engine's level-1 sleep before each wake (D2H, both devices at once)
            rates = [s["bytes"] / s["seconds"] / 1e9 for s in sleeps]
            out.setdefault("sleep_gbps_median", []).append(_median(rates))
        out["bytes_ok"] = out["bytes_ok"] and all(p.get("bytes_ok", True) for p in per)
    if gpu:
        out["gpu_clock_gbps_median"] = gpu
    if limits:
        out["of_multi_gpu_limit"] = [
            round(r / lim, 3) for r, lim in zip(out["gbps_median"], limits, strict=True)
        ]
    if inprocess:
        out["of_inprocess_limit"] = [
            round(r / lim, 3) for r, lim in zip(out["gbps_median"], inprocess, strict=True)
        ]
    return out


def _ratio(figures: Json, a: str, b: str) -> list[float] | None:
    fa, fb = figures.get(a, {}), figures.get(b, {})
    if "gbps_median" not in fa or "gbps_median" not in fb:
        return None
    return [round(x / y, 3) for x, y in zip(fa["gbps_median"], fb["gbps_median"], strict=True)]


def summarize(report: Json) -> Json:
    """Figures per variant, and per hypothesis the ratios that decide it."""
    size = report["bytes_per_device"]
    child = report.get("multi_gpu_limit") or {}
    devices = len(report["variants"].get("limit", {}).get("rounds", [[{}, {}]])[0])
    limits = (
        [child[f"h2d_together_gbps_cuda{i}"] for i in range(devices)]
        if "h2d_together_gbps_cuda0" in child
        else []
    )
    limit_rounds = report["variants"].get("limit", {}).get("rounds") or []
    inprocess = (
        [max(size / r[i]["seconds"] / 1e9 for r in limit_rounds) for i in range(devices)]
        if limit_rounds
        else []
    )
    figures = {
        name: variant_figures(result, size, limits, inprocess)
        for name, result in report["variants"].items()
    }
    if limits:
        figures["multi_gpu_limit"] = {"gbps_median": limits}
    evidence = {}
    for h in HYPOTHESES:
        pairs = ([h["compare"]] if h["compare"] else []) + h["also"]
        evidence[h["id"]] = {f"{a} / {b}": _ratio(figures, a, b) for a, b in pairs}
    if report.get("ack_reads", {}).get("read_seconds_median") is not None:
        evidence["ack"]["two_nvml_reads_ms"] = round(
            2e3 * report["ack_reads"]["read_seconds_median"], 2
        )
    return {
        "headline_of_multi_gpu_limit": {
            name: figures[name]["of_multi_gpu_limit"]
            for name in HEADLINE
            if "of_multi_gpu_limit" in figures.get(name, {})
        },
        "multi_gpu_limit_gbps": limits,
        "inprocess_limit_best_gbps": inprocess,
        "variants": figures,
        "evidence": evidence,
        "all_bytes_ok": all(f.get("bytes_ok", True) for f in figures.values()),
    }
