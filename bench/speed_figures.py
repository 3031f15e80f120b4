"""Pure figures of ``bench/speed.py``: issue 23's ratios read from each part's own report.

Every function takes the unedited JSON of one existing bench and returns the figures with the
limits that bench measured in the same run; :func:`summary` puts issue 23's keys together,
``None`` with a ``missing`` reason for a key no part measured.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

Json = dict[str, Any]

# issue 23's summary keys, each with its goal: (comparison, value)
GOALS: dict[str, tuple[str, float]] = {
    # kubectl patch -> Active as the operator hands over by default (overlapped where both
    # workers can: kubectl's process and the status write inside)
    "handover_over_serial_bound": ("<=", 1.05),
    "overlapped_over_serial_bound": ("<=", 0.65),
    # the same with --no-overlapped-handover: every wake after the sleep's ACK
    "serial_patch_to_active_over_serial_bound": ("<=", 1.05),
    "operator_p50_ms": ("<=", 50.0),
    "cold_start_first_token_s": ("<=", 6.0),
    "vllm_l1_wake_of_h2d": (">=", 0.9),
    "vllm_cold_start_s": ("<=", 20.0),
    "multi_gpu_wake_of_limit": (">=", 0.9),
}


def handover(report: Json) -> Json:
    """``bench/gpu_e2e.py``: each ``kubectl patch`` -> Active against its serial copy bound
    (the loser's weights out at the D2H limit, then the gainer's in at the H2D limit); ``mode``
    says how the operator handed over (``overlapped``: the default)."""
    lim, models = report["limits"], report["models"]
    size = {"llm": models["llm_weight_bytes"], "sd": models["sd_weight_bytes"]}
    d2h, h2d = lim["d2h_pinned_gbps"] * 1e9, lim["h2d_pinned_gbps"] * 1e9
    rows = []
    for r in report["runs"]:
        bound = size[r["loser"]] / d2h + size[r["gainer"]] / h2d
        rows.append({"total_s": r["total_s"], "bound_s": bound, "ratio": r["total_s"] / bound})
    return {
        "handovers": len(rows),
        "mode": "overlapped" if report.get("overlapped_handover") else "serial",
        "all_acks_ok": report["all_acks_ok"],
        "handover_over_serial_bound": statistics.median(r["ratio"] for r in rows),
        "patch_to_active_p50_s": statistics.median(r["total_s"] for r in rows),
        "serial_bound_p50_s": statistics.median(r["bound_s"] for r in rows),
        **operator_share(report),
        "operator_with_kubectl_p50_ms": report["operator_ms"]["p50"],
        "workers_p50_ms": report["workers_ms"]["p50"],
        "weight_bytes": size,
        "limits": {k: lim[k] for k in ("h2d_pinned_gbps", "d2h_pinned_gbps") if k in lim},
    }


def handover_serial(report: Json) -> Json:
    """``bench/gpu_e2e.py`` without ``--overlapped``: as :func:`handover`, the operator with
    ``--no-overlapped-handover``; its ratio is ``serial_patch_to_active_over_serial_bound``."""
    out = handover(report)
    out["serial_patch_to_active_over_serial_bound"] = out.pop("handover_over_serial_bound")
    return out


def operator_share(report: Json) -> Json:
    """The operator's share of a ``gpu_e2e`` hand-over, without kubectl's own process (its
    start-up, about 60-90 ms, is the client's): from the PATCH sent where kubectl logged its
    round trip, else from its answer; a report with neither counts kubectl in (its basis
    says which)."""
    for key, basis in (
        ("operator_from_patch_ms", "from the PATCH sent"),
        ("operator_from_answer_ms", "from the PATCH answered (the API server's write not counted)"),
        ("operator_ms", "from kubectl's start (kubectl's own process counted)"),
    ):
        if key in report:
            share = report[key]
            return {
                "operator_p50_ms": share["p50"],
                "operator_p95_ms": share["p95"],
                "operator_basis": basis,
            }
    raise KeyError("the report holds no operator figure")


def operator(report: Json) -> Json:
    """``bench/operator_switch.py``: the operator's share of a hand-over on the local control
    plane (patch to Active minus the workers' own sleep and wake), with its step budget."""
    return {
        "switches": report["switches"],
        "operator_p50_ms": report["overhead_ms"]["p50"],
        "operator_p95_ms": report["overhead_ms"]["p95"],
        "budget_p50_ms": report.get("budget_p50_ms", {}),
        "operator_cpu_ms_per_switch": report["operator_cpu_ms_per_switch"],
        "round_api_requests_per_switch": report["round_api_requests_per_switch"],
    }


def coldstart(report: Json) -> Json:
    """``bench/coldstart.py``: process spawn to the first token, with its limits."""
    s, lim = report["summary"], report["limits"]
    keep = (
        "weights_gib",
        "cold_start_first_token_runs_s",
        "read_limit_s",
        "h2d_limit_s",
        "process_floor_s",
        "cold_start_first_token_cold_cache_s",
        "cold_cache_method",
    )
    return {
        "cold_start_first_token_s": s["cold_start_first_token_s"],
        **{k: s[k] for k in keep if k in s},
        "limits": {k: v for k, v in lim.items() if isinstance(v, int | float)},
    }


def vllm(report: Json) -> Json:
    """``bench/vllm_stage.py``: a vLLM stage's level-1 wake against H2D, and its cold start as
    the operator gives it: from the wake of its pre-warmed pod (vLLM imported before it was
    asked) to the first token, where the report measured it; else the restart's, its compile
    caches kept as a volume keeps them; else the first start's; ``cold_start_basis`` says which
    (the pod's own start is beside it: ``cold_start_spawn_s``)."""
    s = report["summary"]
    kept = s.get("cold_start_caches_kept_seconds")
    spawn = s["cold_start_seconds"] if kept is None else kept
    prewarmed = s.get("prewarmed_wake_to_first_token_seconds")
    basis = "first start, caches cold" if kept is None else "caches kept"
    return {
        **vllm_wake(report),
        "vllm_cold_start_s": spawn if prewarmed is None else prewarmed,
        "cold_start_basis": basis if prewarmed is None else "pre-warmed pod, wake -> first token",
        "cold_start_spawn_s": spawn,
        "cold_start_first_s": s["cold_start_seconds"],
        "weights_gib": s["weights_gib"],
        "l1_sleep_ratio_to_d2h": s.get("l1_sleep_ratio_to_d2h"),
        "l2_wake_seconds_median": s.get("l2_wake_seconds_median"),
    }


FLOOR_KEYS = (
    "l1_wake_floor_seconds", "l1_wake_floor_of_h2d", "l1_wake_of_floor",
    "l1_rested_wake_floor_seconds", "l1_rested_wake_floor_of_h2d", "l1_rested_wake_of_floor",
    "l1_rested_wake_engine_of_floor",
)  # fmt: skip
"""``bench/vllm_wake_floor.py``'s figures in a vLLM report's summary (absent before 2026-11-30)."""


def l1_wake(s: Json) -> Json:
    """Issue 23's vLLM wake: the median of the stage's level-1 wakes in hand-overs (after the
    other stage's sleep, as the operator orders them), where the report has them (from
    2026-11-30); else the wake right after its own sleep, when the driver still cleans the
    117 GB that sleep released (floor 0.50 of H2D on an H200); the basis says which."""
    if "l1_handover_wake_ratio_to_h2d" in s:
        return {
            "vllm_l1_wake_of_h2d": s["l1_handover_wake_ratio_to_h2d"],
            "l1_wake_basis": f"in a hand-over, after the other stage's sleep "
            f"(median of {s['handovers']})",
            "l1_right_after_sleep_wake_ratio_to_h2d": s["l1_wake_ratio_to_h2d"],
        }
    return {
        "vllm_l1_wake_of_h2d": s["l1_wake_ratio_to_h2d"],
        "l1_wake_basis": "right after its sleep",
    }


def wake_floor(s: Json) -> Json:
    """The level-1 wakes against their floor without vLLM, where the report measured it."""
    return {k: s[k] for k in FLOOR_KEYS if k in s}


def vllm_wake(report: Json) -> Json:
    """``bench/vllm_stage.py`` run for its level-1 wakes alone (speed's ``vllm_wake`` part):
    right after the sleep against H2D (issue 23's key), rested, and both against their floor;
    the ``vllm`` part's figures start from these."""
    s, lim = report["summary"], report["limits"]
    return {
        **l1_wake(s),
        "l1_wake_seconds_median": s.get("l1_wake_seconds_median"),
        "l1_rested_wake_ratio_to_h2d": s.get("l1_rested_wake_ratio_to_h2d"),
        **wake_floor(s),
        "all_acks_ok": s["all_acks_ok"],
        "all_tokens_identical": s["all_tokens_identical"],
        "limits": {k: lim[k] for k in ("h2d_pinned_gbps", "d2h_pinned_gbps") if k in lim},
    }


def multi_gpu(report: Json) -> Json:
    """``bench/multi_gpu.py``: both stages' level-1 wakes per device against that device's
    limit when both devices copy at once; the key is the slowest device of either stage."""
    s = report["summary"]
    fractions = [*s["a_wake_fraction_of_together_limit"], *s["b_wake_fraction_of_together_limit"]]
    return {
        "multi_gpu_wake_of_limit": min(fractions),
        "wake_fractions": {
            "a": s["a_wake_fraction_of_together_limit"],
            "b": s["b_wake_fraction_of_together_limit"],
        },
        "all_acks_ok": s["all_acks_ok"],
        "limits": report["limits"],
    }


def overlap(report: Json) -> Json:
    """``bench/overlap.py``: overlapped hand-overs between two workers (the caller relaying
    each measured release) against the serial copy bound, with the NVML sampler's room check
    (per process, and the device's memory charged to none counted too); ``handoff``: the
    pieces were handed from one worker to the other instead of freed."""
    s = report["summary"]
    handoff = bool(s.get("handoff"))
    return {
        "overlapped_over_serial_bound": s["overlapped_over_serial_bound"],
        "overlapped_seconds_median": s["overlapped_seconds_median"],
        "overlapped_count": s["overlapped_count"],
        "serial_over_serial_bound": s["serial_over_serial_bound"],
        "overlapped_physical_bound_s": s["overlapped_physical_bound_s"],
        "serial_bound_s": s["serial_bound_s"],
        "all_acks_ok": s["all_acks_ok"],
        "all_tokens_identical": s["all_tokens_identical"],
        "samples_over_room": s["samples_over_room"],
        "device_samples_over_room": s.get("device_samples_over_room"),
        "handoff": handoff,
        "limits": report["limits"],
        "basis": "worker level: bench/overlap.py relays as the operator orders it"
        + (", the pieces handed over (--handoff)" if handoff else ", the pieces freed"),
    }


# which part measures which key; the first part that ran wins (the GPU hand-over's operator
# share before the local control plane's)
SOURCES: dict[str, tuple[str, ...]] = {
    "handover_over_serial_bound": ("handover",),
    "overlapped_over_serial_bound": ("overlap",),
    "serial_patch_to_active_over_serial_bound": ("handover_serial",),
    "operator_p50_ms": ("handover", "operator"),
    "cold_start_first_token_s": ("coldstart",),
    "vllm_l1_wake_of_h2d": ("vllm_wake", "vllm"),
    "vllm_cold_start_s": ("vllm",),
    "multi_gpu_wake_of_limit": ("multi_gpu",),
}


def summary(figures: Mapping[str, Json], missing_parts: Mapping[str, str]) -> Json:
    """Issue 23's keys from the parts' figures; ``missing`` says why a key is ``None``,
    ``source`` which part measured it, ``met`` whether its goal is met."""
    out: Json = {}
    missing: dict[str, str] = {}
    source: dict[str, str] = {}
    met: dict[str, bool] = {}
    for key, parts in SOURCES.items():
        found = next((p for p in parts if p in figures and key in figures[p]), None)
        if found is None:
            out[key] = None
            reasons = [f"{p}: {missing_parts[p]}" for p in parts if p in missing_parts]
            missing[key] = "; ".join(reasons) or "no part that measures it ran"
            continue
        value = figures[found][key]
        out[key] = value
        source[key] = found
        op, goal = GOALS[key]
        met[key] = value <= goal if op == "<=" else value >= goal
    out["missing"] = missing
    out["source"] = source
    out["goals"] = {k: f"{op} {goal:g}" for k, (op, goal) in GOALS.items()}
    out["met"] = met
    return out


FIGURES = {
    "handover": handover,
    "operator": operator,
    "coldstart": coldstart,
    "vllm": vllm,
    "vllm_wake": vllm_wake,
    "multi_gpu": multi_gpu,
    "overlap": overlap,
    "handover_serial": handover_serial,
}
