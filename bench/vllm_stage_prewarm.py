"""A pre-warmed vLLM stage's start, as ``bench/vllm_stage.py --prewarmed N`` measures it.

The worker is spawned asleep at level 2 (``--initial-state=asleep --sleep-level=2``): it imports
vLLM and checks its flags, and the engine core's fork server preloads beside it, but no engine
starts. Recorded per start: the seconds from the spawn to ASLEEP (the imports, off the path of a
hand-over), the device's used memory then against before the spawn (an outside NVML reading:
the pre-warmed stage must hold nothing), then from the WakeUp call: its ACK (the engine's
start, load, KV pool and calibration) and the first token, and whether the tokens match the
Active start's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.vllm_stage_workers import Outside, Worker, start_worker, wait_state
from bench.worker_grpc import SLEEP
from omnistage.worker.v1 import types_pb2

Json = dict[str, Any]
PREWARM_FLAGS = ("--initial-state=asleep", "--sleep-level=2")


def prewarmed_args(args: list[str]) -> list[str]:
    """The Active stage's worker flags with its start made pre-warmed."""
    kept = [x for x in args if not x.startswith(("--initial-state=", "--sleep-level="))]
    return [*kept, *PREWARM_FLAGS]


def prewarmed_start(
    args: list[str], env: dict[str, str], log: Path, outside: Outside, *, prompt: str,
    tokens: int, reference: list[int],
) -> tuple[Worker, Json]:  # fmt: skip
    """Spawn the pre-warmed worker, wake it, take its first tokens; the worker (Active) and
    the figures."""
    before = outside.read()
    llm = start_worker("vllm-prewarmed", prewarmed_args(args), env, log, ready=SLEEP, timeout=900)
    try:
        wait_state(llm, types_pb2.WORKER_STATE_ASLEEP, 900)
        asleep_at = time.time()
        held = outside.read()
        st = llm.status()
        began = time.time()
        wake = llm.wake()
        woken = time.time()
        got = llm.generate(prompt, tokens)
        first_token = time.time()
    except BaseException:
        llm.stop()
        raise
    return llm, {
        "spawn_to_asleep_seconds": asleep_at - llm.spawned_at,
        "asleep_level": int(st.level),
        "worker_used_bytes_asleep": int(st.used_bytes),
        "outside_used_before_spawn": before["used"],
        "outside_used_asleep": held["used"],
        "wake": wake,
        "wake_seconds": woken - began,
        "wake_to_first_token_seconds": first_token - began,
        "spawn_to_first_token_seconds": first_token - llm.spawned_at,
        "tokens_identical": got == reference,
    }


def prewarm_summary(runs: list[Json]) -> Json:
    """Medians over the pre-warmed starts (the summary's ``prewarmed_*``)."""
    if not runs:
        return {}

    def median(key: str) -> float:
        xs = sorted(float(r[key]) for r in runs)
        return xs[len(xs) // 2]

    return {
        "prewarmed_wake_to_first_token_seconds": median("wake_to_first_token_seconds"),
        "prewarmed_wake_seconds": median("wake_seconds"),
        "prewarmed_spawn_to_asleep_seconds": median("spawn_to_asleep_seconds"),
        "prewarmed_held_bytes_max": max(
            int(r["outside_used_asleep"]) - int(r["outside_used_before_spawn"]) for r in runs
        ),
        "prewarmed_all_acks_ok": all(bool(r["wake"].get("ok")) for r in runs),
        "prewarmed_tokens_identical": all(bool(r["tokens_identical"]) for r in runs),
    }
