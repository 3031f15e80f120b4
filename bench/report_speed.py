"""The README lines for ``bench/speed.py``'s summary (issue 23's figures in one JSON);
bench/report.py calls it."""

from __future__ import annotations

from typing import Any

ROWS = (
    (
        "handover_over_serial_bound",
        "`kubectl patch` -> Active / serial copy bound (overlapped, the operator's default)",
        "{:.2f}",
    ),
    ("operator_p50_ms", "the operator's share of a hand-over, p50", "{:.0f} ms"),
    ("cold_start_first_token_s", "cold start, spawn -> first token", "{:.2f} s"),
    ("vllm_l1_wake_of_h2d", "vLLM stage level-1 wake / H2D", "{:.2f}"),
    ("vllm_cold_start_s", "vLLM stage cold start", "{:.1f} s"),
    ("multi_gpu_wake_of_limit", "multi-GPU wake / each device's limit", "{:.3f}"),
    ("overlapped_over_serial_bound", "overlapped hand-over / serial copy bound", "{:.2f}"),
    (
        "serial_patch_to_active_over_serial_bound",
        "`kubectl patch` -> Active / serial copy bound, `--no-overlapped-handover`",
        "{:.2f}",
    ),
)


def _wake_basis(vllm: dict[str, Any]) -> str | None:
    """Which vLLM wake the key holds, and the others beside it against their floor without
    vLLM (same run), where they were measured."""
    if "l1_wake_basis" not in vllm:
        return None
    basis = str(vllm["l1_wake_basis"])
    if "l1_wake_floor_of_h2d" in vllm:
        right_after = vllm.get("l1_right_after_sleep_wake_ratio_to_h2d")
        if right_after is not None:
            basis += f"; right after its own sleep {right_after:.2f}"
        basis += (
            f" (that wake without vLLM {vllm['l1_wake_floor_of_h2d']:.2f}), after 3 s asleep "
            f"{vllm['l1_rested_wake_ratio_to_h2d']:.2f} ({vllm['l1_rested_wake_floor_of_h2d']:.2f})"
        )
    return basis


def speed_section(data: dict[str, Any]) -> list[str]:
    """One row per figure of the summary: now, goal, met, and which part measured it."""
    s = data["summary"]
    figures = data.get("figures", {})
    bases = {
        "operator_p50_ms": (
            figures.get(s.get("source", {}).get("operator_p50_ms", "handover")) or {}
        ).get("operator_basis"),
        "vllm_cold_start_s": (figures.get("vllm") or {}).get("cold_start_basis"),
        "vllm_l1_wake_of_h2d": _wake_basis(
            figures.get(s.get("source", {}).get("vllm_l1_wake_of_h2d", "vllm")) or {}
        ),
    }
    lines = [
        "",
        f"Issue 23's figures in one JSON, `bench/speed.py` (`bench/results/speed.json`, "
        f"{data['date'][:10]}; each part's latest committed report, its own machine and day: "
        "[bench/results/README.md](bench/results/README.md#speedjson-issue-23-every-figure-in-"
        "one-json--read-from-the-parts-latest-reports)).",
        "",
        "| figure | now | goal | met | measured by |",
        "|---|---|---|---|---|",
    ]
    for key, label, fmt in ROWS:
        value = s.get(key)
        now = fmt.format(value) if value is not None else "not measured"
        met = s.get("met", {}).get(key)
        where = s.get("source", {}).get(key, "-")
        basis = bases.get(key)
        named = f"{label}, {basis}" if basis else label
        lines.append(
            f"| {named} | {now} | {s['goals'][key]} | "
            f"{'-' if met is None else ('yes' if met else '**no**')} | {where} |"
        )
    return lines
