"""The summary of ``bench/vllm_stage.py``'s report (pure): the level-1 and level-2 cycles'
medians against the copy limits, the rested wakes, the engine's own phases, the hand-overs and
the wakes against their floor without vLLM (``bench/vllm_wake_floor.py``)."""

from __future__ import annotations

from typing import Any

from bench import vllm_wake_floor
from bench.vllm_stage_prewarm import prewarm_summary

Json = dict[str, Any]
GiB = 1024**3


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def summarize(r: Json) -> Json:
    weights = r["build"]["vllm"]["bytes"]
    lim = r["limits"]
    out: Json = {"weights_gib": weights / GiB, "cold_start_seconds": r["cold_start_seconds"]}
    out.update(prewarm_summary(r.get("prewarmed", [])))
    restarts = r.get("restarts", [])
    if restarts:  # a restart's caches are the first start's: the cold start a stage's volume gives
        out["cold_start_caches_kept_seconds"] = _median([x["cold_start_seconds"] for x in restarts])
        out["restart_tokens_identical"] = all(x["tokens_identical"] for x in restarts)
    for level in (1, 2):
        rows = [c for c in r["cycles"] if c["level"] == level and not c.get("rest_s")]
        if not rows:
            continue
        sleep_s = _median([c["sleep"]["worker_seconds"] for c in rows])
        wake_s = _median([c["wake"]["worker_seconds"] for c in rows])
        out[f"l{level}_sleep_seconds_median"] = sleep_s
        out[f"l{level}_wake_seconds_median"] = wake_s
        out[f"l{level}_wake_gbps"] = weights / wake_s / 1e9
        out[f"l{level}_max_residual_bytes"] = max(c["sleep"]["used_after_bytes"] for c in rows)
        out[f"l{level}_residual_bound_bytes"] = rows[0]["sleep"]["residual_bound_bytes"]
        out[f"l{level}_max_outside_used_after_sleep_bytes"] = max(
            c["outside_after_sleep"]["used"] for c in rows
        )
        if level == 1:
            out["l1_sleep_gbps"] = weights / sleep_s / 1e9
            out["l1_sleep_ratio_to_d2h"] = out["l1_sleep_gbps"] / lim["d2h_pinned_gbps"]
            out["l1_wake_ratio_to_h2d"] = out["l1_wake_gbps"] / lim["h2d_pinned_gbps"]
            out.update(engine_phases(rows, lim))
    out.update(rested(r, weights, lim))
    out.update(vllm_wake_floor.summary(r, out))
    out.update(handovers(r, weights, lim))
    hs = r.get("handovers") or [r["handover"]]
    acks = [c["sleep"] for c in r["cycles"]] + [c["wake"] for c in r["cycles"]]
    acks += [h[k] for h in hs for k in ("vllm_sleep", "torch_wake", "torch_sleep", "vllm_wake")]
    out["all_acks_ok"] = all(a["ok"] for a in acks)
    out["all_tokens_identical"] = all(c["tokens_identical"] for c in r["cycles"]) and all(
        h["vllm_tokens_identical"] for h in hs
    )
    out["all_refused_while_asleep"] = all(
        c["generate_while_asleep"].startswith("FAILED_PRECONDITION") for c in r["cycles"]
    )
    out["deepen_refused"] = str(r["deepen"]["sleep2"]).startswith("FAILED_PRECONDITION")
    out["residual_within_bound"] = all(
        c["sleep"]["used_after_bytes"] <= c["sleep"]["residual_bound_bytes"] for c in r["cycles"]
    )
    return out


def handovers(r: Json, weights: int, lim: Json) -> Json:
    """The hand-overs vLLM -> torch -> vLLM (``--handovers``; ``handover`` alone before
    2026-11-30): medians of both directions, and of the vLLM stage's level-1 wake in them (after
    the other stage's sleep, as the operator orders it) against H2D."""
    hs = r.get("handovers") or [r["handover"]]
    wake_s = _median([h["vllm_wake"]["worker_seconds"] for h in hs])
    return {
        "handovers": len(hs),
        "handover_vllm_to_torch_seconds": _median([h["vllm_to_torch_seconds"] for h in hs]),
        "handover_torch_to_vllm_seconds": _median([h["torch_to_vllm_seconds"] for h in hs]),
        "l1_handover_wake_seconds_median": wake_s,
        "l1_handover_wake_ratio_to_h2d": weights / wake_s / 1e9 / lim["h2d_pinned_gbps"],
    }


def rested(r: Json, weights: int, lim: Json) -> Json:
    """The level-1 wakes after a rest asleep (``--rest-s``): by then the driver has cleaned the
    memory the sleep released (``scrub_probe.json``), as when another stage served between the
    two; the wakes right after their sleep map memory the driver is still cleaning."""
    rows = [c for c in r["cycles"] if c["level"] == 1 and c.get("rest_s")]
    if not rows:
        return {}
    wake_s = _median([c["wake"]["worker_seconds"] for c in rows])
    out: Json = {"l1_rested_rest_s": rows[0]["rest_s"], "l1_rested_wake_seconds_median": wake_s}
    out["l1_rested_wake_ratio_to_h2d"] = weights / wake_s / 1e9 / lim["h2d_pinned_gbps"]
    phases = engine_phases(rows, lim)
    for key in ("l1_wake_engine_seconds_median", "l1_wake_engine_ratio_to_h2d",
                "l1_wake_phases_median"):  # fmt: skip
        if key in phases:
            out[key.replace("l1_", "l1_rested_", 1)] = phases[key]
    return out


def engine_phases(rows: list[Json], lim: Json) -> Json:
    """The fast sleep/wake's own figures over the level-1 cycles (its log lines): medians of
    its seconds and of each phase, its copy rate against the limit (without the RPCs and
    measurements around it that the ACK's seconds include). ``fast_wake`` false: no lines."""
    out: Json = {"fast_wake": all(c["sleep_phases"] and c["wake_phases"] for c in rows)}
    if not out["fast_wake"]:
        return out
    for kind, limit in (("sleep", "d2h_pinned_gbps"), ("wake", "h2d_pinned_gbps")):
        lines = [c[f"{kind}_phases"][-1] for c in rows]
        seconds = _median([p["total_seconds"] for p in lines])
        out[f"l1_{kind}_engine_seconds_median"] = seconds
        out[f"l1_{kind}_engine_ratio_to_{limit[:3]}"] = (
            lines[0]["copy_bytes"] / seconds / 1e9 / lim[limit] if seconds > 0 else None
        )
        names = sorted({n for p in lines for n in p["seconds"]})
        out[f"l1_{kind}_phases_median"] = {
            n: _median([p["seconds"].get(n, 0.0) for p in lines]) for n in names
        }
    return out
