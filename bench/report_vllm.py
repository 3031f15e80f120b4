"""The README lines for ``bench/vllm_stage.py``'s report (a vLLM stage on the GPU host, and its
restarts with the compile caches kept); bench/report.py calls it."""

from __future__ import annotations

from typing import Any

from bench.report_serving import ok

MiB = 1024**2


def _vllm_engine_row(s: dict[str, Any]) -> list[str]:
    """The fast sleep/wake's own L1 figures (its log lines), where the run has them."""
    if not s.get("fast_wake"):
        return []
    return [
        f"| L1 sleep / wake inside the engine (fast path, without the RPCs) | "
        f"{s['l1_sleep_engine_seconds_median']:.3f} s ({s['l1_sleep_engine_ratio_to_d2h']:.0%} "
        f"of D2H) / {s['l1_wake_engine_seconds_median']:.3f} s "
        f"({s['l1_wake_engine_ratio_to_h2d']:.0%} of H2D) |"
    ]


def _vllm_restart_row(forkserver: dict[str, Any] | None, spawn: dict[str, Any] | None) -> list[str]:
    """The stage started again with its compile caches kept, its engine core from the fork
    server against spawned (two runs of one machine call)."""
    if not forkserver or not spawn:
        return []
    kept = forkserver["summary"]["cold_start_caches_kept_seconds"]
    spawned = spawn["summary"]["cold_start_caches_kept_seconds"]
    return [
        f"| cold start again, compile caches kept (engine core from the fork server / "
        f"spawned, {forkserver['machine']['date'][:10]}) | {kept:.1f} s / {spawned:.1f} s |"
    ]


def _vllm_pieces_rows(pieces: dict[str, Any] | None, whole: dict[str, Any] | None) -> list[str]:
    """The KV cache mapped in pieces at a wake against mapped whole (two runs of one call)."""
    if not pieces or not whole:
        return []
    p, w = pieces["summary"], whole["summary"]
    day = pieces["machine"]["date"][:10]
    return [
        f"| L1 wake after 3 s asleep, KV cache mapped in pieces / whole ({day}, one call) | "
        f"{p['l1_rested_wake_seconds_median']:.3f} s ({p['l1_rested_wake_ratio_to_h2d']:.0%} of "
        f"H2D) / {w['l1_rested_wake_seconds_median']:.3f} s "
        f"({w['l1_rested_wake_ratio_to_h2d']:.0%}) |",
        f"| L1 wake right after its sleep, in pieces / whole (same runs) | "
        f"{p['l1_wake_seconds_median']:.3f} s ({p['l1_wake_ratio_to_h2d']:.0%} of H2D) / "
        f"{w['l1_wake_seconds_median']:.3f} s ({w['l1_wake_ratio_to_h2d']:.0%}) |",
        f"| hand-over torch -> vLLM, in pieces / whole (same runs) | "
        f"{p['handover_torch_to_vllm_seconds']:.2f} s / "
        f"{w['handover_torch_to_vllm_seconds']:.2f} s |",
    ]


def _vllm_prewarm_rows(prewarm: dict[str, Any] | None) -> list[str]:
    """A pre-warmed pod (asleep at level 2, vLLM imported) woken: its start as the operator
    gives it, against the pod's own start with caches kept in the same run."""
    if not prewarm or "prewarmed_wake_to_first_token_seconds" not in prewarm["summary"]:
        return []
    s, runs = prewarm["summary"], prewarm["prewarmed"]
    day = prewarm["machine"]["date"][:10]
    return [
        f"| pre-warmed pod woken: WakeUp -> first token / its ACK ({day}, {len(runs)} starts, "
        f"upper median) | {s['prewarmed_wake_to_first_token_seconds']:.1f} s / "
        f"{s['prewarmed_wake_seconds']:.1f} s |",
        f"| pre-warmed pod: spawn -> asleep (imports, before it is asked); device memory it "
        f"holds | {s['prewarmed_spawn_to_asleep_seconds']:.1f} s; "
        f"{max(0, s['prewarmed_held_bytes_max']) / MiB:.0f} MiB (NVML, outside) |",
        f"| the pod's own start, caches kept (same run) | "
        f"{s['cold_start_caches_kept_seconds']:.1f} s |",
    ]


def _vllm_floor_rows(floor: dict[str, Any] | None) -> list[str]:
    """The level-1 wakes against the same wake without vLLM (bench/vllm_wake_floor.py), the
    floor's own share of H2D beside it (what on this layout no order of the driver's calls beat),
    and the wake in hand-overs where the run made several."""
    if not floor or "l1_wake_floor_seconds" not in floor["summary"]:
        return []
    s, day = floor["summary"], floor["machine"]["date"][:10]
    rows = []
    for when, key in (("right after its sleep", "l1_"), ("after 3 s asleep", "l1_rested_")):
        rows.append(
            f"| L1 wake {when}: ACK / its floor without vLLM ({day}, same run) | "
            f"{s[key + 'wake_seconds_median']:.3f} s / {s[key + 'wake_floor_seconds']:.3f} s "
            f"(at {s[key + 'wake_of_floor']:.0%} of the floor's speed; the floor "
            f"{s[key + 'wake_floor_of_h2d']:.0%} of H2D) |"
        )
    if "l1_handover_wake_seconds_median" in s:
        rows.append(
            f"| L1 wake in a hand-over, after the torch stage's sleep (median of "
            f"{s['handovers']}) | {s['l1_handover_wake_seconds_median']:.3f} s "
            f"({s['l1_handover_wake_ratio_to_h2d']:.0%} of H2D) |"
        )
    return rows


def vllm_section(
    data: dict[str, Any],
    forkserver: dict[str, Any] | None = None,
    spawn: dict[str, Any] | None = None,
    pieces: tuple[dict[str, Any] | None, dict[str, Any] | None] = (None, None),
    prewarm: dict[str, Any] | None = None,
    *,
    floor: dict[str, Any] | None = None,
) -> list[str]:
    """A vLLM stage on the GPU host (bench/vllm_stage.py): the worker's ACKs and the limits;
    the restarts' cold starts from the fork-server run and its spawned twin, where given."""
    m, s, lim = data["machine"], data["summary"], data["limits"]
    return [
        "",
        f"A vLLM stage, `bench/vllm_stage.py` on {m.get('gpu', '?')} (vLLM {m.get('vllm')}, "
        f"torch {m.get('torch')}, {m['date'][:10]}): the real worker over gRPC, a "
        f"{s['weights_gib']:.1f} GiB causal LM (random bf16 weights), figures from its ACKs "
        f"(NVML over the engine's process tree); copy limits in the same run: H2D "
        f"{lim['h2d_pinned_gbps']:.1f} GB/s, D2H {lim['d2h_pinned_gbps']:.1f} GB/s.",
        "",
        "| figure | value |",
        "|---|---|",
        f"| cold start (spawn to first token) | {s['cold_start_seconds']:.1f} s |",
        *_vllm_restart_row(forkserver, spawn),
        *_vllm_prewarm_rows(prewarm),
        f"| L1 sleep / wake | {s['l1_sleep_seconds_median']:.2f} s "
        f"({s['l1_sleep_ratio_to_d2h']:.0%} of D2H) / {s['l1_wake_seconds_median']:.2f} s "
        f"({s['l1_wake_ratio_to_h2d']:.0%} of H2D) |",
        *_vllm_engine_row(s),
        *_vllm_pieces_rows(*pieces),
        *_vllm_floor_rows(floor),
        f"| L2 sleep / wake (reload from disk) | {s['l2_sleep_seconds_median']:.2f} s / "
        f"{s['l2_wake_seconds_median']:.2f} s |",
        f"| residual after sleep (ACK, bound) | {s['l1_max_residual_bytes'] / MiB:.0f} MiB "
        f"(bound {s['l1_residual_bound_bytes'] / MiB:.0f} MiB), within: "
        f"{ok(s['residual_within_bound'])} |",
        f"| hand-over vLLM -> torch / torch -> vLLM | "
        f"{s['handover_vllm_to_torch_seconds']:.2f} s / "
        f"{s['handover_torch_to_vllm_seconds']:.2f} s |",
        f"| all ACKs ok; token ids identical after every wake; 1 -> 2 refused | "
        f"{ok(s['all_acks_ok'])}; {ok(s['all_tokens_identical'])}; "
        f"{ok(s['deepen_refused'])} |",
    ]
