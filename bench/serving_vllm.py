"""A vLLM stage against bare ``vllm serve``: same vLLM, model, flags and GPU, 64 clients.

Run on the lent GPU machine with vLLM 0.24.0 staged (``bench/vllm_bundle.py``,
``bench/vllm_host_setup.sh``; see bench/results/serving_vllm.md). It builds a random-weight
Llama (~8 GiB bf16, from a config) with a byte-level tokenizer made locally with the
``tokenizers`` library (``bench/vllm_tokenizer.py``), then, one after the other on the GPU:

1. bare: vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) with the
   flags the stage gives its engine (``runners.vllm_serve.serve_argv``: the same list);
2. stage: the omnistage worker (this tree) of a vLLM stage, its HTTP port (vLLM's app behind
   the worker's gate) under the same load;
3. swaps: the stage (OnDemand) under the same load while a Sleep(1)+WakeUp over gRPC runs
   every ``--swap-every`` seconds for ``--swap-seconds``: every request must be answered in
   full; throughput between swaps is compared with the steady figure of step 2.

The load (``bench/serving_load.py``): ``--clients`` concurrent clients, each sending streamed
completions back to back from a fixed mix of prompt/output lengths (prompts as token ids,
``ignore_eos``, so every length is exact); tokens counted from ``usage``
(``stream_options.include_usage``), TTFT is the time to the first streamed text. ``--smoke``
runs the same code on CPU with the stand-in engine (tests/fakevllm) on a simulated GPU.

``--rounds N`` runs 1 and 2 side by side instead: both servers up on the GPU at once (the
stage once bare is up), N steady loads of each, alternating, so the machine's drift falls on
both. Each steady load records the CPU seconds of every process and thread of the server's
tree (``bench/proc_account.py``); ``--py-spy`` profiles one more load of each server's top
process (vLLM's API server, the stage's worker).

    python3 bench/serving_vllm.py --workdir /tmp/vllmserve --out bench/results/serving_vllm.json
    python bench/serving_vllm.py --smoke --workdir /tmp/vllmserve-smoke --out /tmp/s.json
    python3 bench/serving_vllm.py --rounds 4 --utilization 0.45 --out serving_vllm_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), str(REPO)]

from bench.serving_load import MIX, figures, load  # noqa: E402
from bench.vllm_servers import (  # noqa: E402
    Server,
    add_engine_arguments,
    build_model,
    env_for,
    machine,
    start_bare,
    start_stage,
    wait_http,
    worker_config,
)
from bench.vllm_swaps import between_swaps, swapper  # noqa: E402

Json = dict[str, Any]


# ---- the run --------------------------------------------------------------------------------


async def run(a: argparse.Namespace) -> Json:
    """The phases asked for (``--phases``), added to the report kept under ``--workdir`` (so
    they can run in consecutive device calls); the summary once all are there."""
    work: Path = a.workdir
    saved = work / "report.json"
    report: Json = json.loads(saved.read_text()) if saved.exists() else {}
    report.setdefault("commands", []).append(" ".join(sys.argv))
    report |= {"smoke": a.smoke, "machine": machine(a.smoke), "mix": MIX, "clients": a.clients}
    report["model"] = build_model(work, a.smoke)
    model = Path(report["model"]["dir"])
    fake_dir: Path | None = None
    if a.smoke:
        from tests.fakegpu.device import FakeGpu
        from tests.fakegpu.model import Device

        fake_dir = work / "fakegpu"
        if not fake_dir.exists():
            FakeGpu.create(fake_dir, Device(uuid="GPU-smoke", total=400_000_000))
    env = env_for(a.smoke, fake_dir)
    from omnistage_worker.runners.vllm_serve import serve_argv

    report["engine_flags"] = serve_argv(worker_config(a, model), a.utilization, tokenizer=True)
    if a.rounds:
        bare_env = {**env, "VLLM_SERVER_DEV_MODE": "1"} if a.bare_sleep_first else env
        bare = start_bare(a, model, bare_env, work / "bare.log")
        stage: Server | None = None
        try:
            # one after the other: an engine's memory profiling at start must not see another
            # engine's allocations come and go
            await ready_for_load(a, bare, "/v1/models", a.bare_sleep_first)
            stage = start_stage(a, model, env, work / "stage.log", "ondemand")
            await ready_for_load(a, stage, "/health", False)
            report |= await alternate(a, bare, stage)
            if a.swap_seconds > 0:
                report["swaps"] = await swapping(a, stage, report["stage"])
        finally:
            bare.stop()
            if stage is not None:
                stage.stop()
        a.phases = []
    if "bare" in a.phases:
        bare_env = {**env, "VLLM_SERVER_DEV_MODE": "1"} if a.bare_sleep_first else env
        bare = start_bare(a, model, bare_env, work / "bare.log")
        report["bare"] = await steady(a, bare, "/v1/models", sleep_first=a.bare_sleep_first)
        report["bare"]["slept_first"] = a.bare_sleep_first
    if "stage" in a.phases:
        # OnDemand, so requests that arrive during a swap are held (a Manual stage answers 409).
        server = start_stage(a, model, env, work / "stage.log", "ondemand")
        try:
            report["stage"] = await steady(a, server, "/health", stop=False)
            if a.swap_seconds > 0:
                report["swaps"] = await swapping(a, server, report["stage"])
        finally:
            server.stop()
    saved.write_text(json.dumps(report))
    if all(k in report for k in ("bare", "stage")):
        report["summary"] = summarize(report)
    return report


async def steady(
    a: argparse.Namespace, server: Server, ready: str, stop: bool = True, sleep_first: bool = False
) -> Json:
    """The steady load: ``--clients`` clients, ``--per-client`` requests each. ``sleep_first``:
    one level-1 sleep and wake through vLLM's dev routes first (what the stage's worker does
    once at start to measure what its engine holds asleep)."""
    try:
        await ready_for_load(a, server, ready, sleep_first)
        out = await measured(a, server) | {"ready_s": round(server.ready_s, 1)}
        if a.py_spy:
            out["profile"] = await profiled(a, server)
        return out
    finally:
        if stop:
            server.stop()


async def ready_for_load(
    a: argparse.Namespace, server: Server, ready: str, sleep_first: bool
) -> None:
    """Wait until ``server`` answers ``ready``, (``sleep_first``) sleep and wake it, warm up."""
    await wait_http(server, ready, a.start_timeout)
    if sleep_first:
        import httpx

        async with httpx.AsyncClient(timeout=600) as client:
            for path in ("/sleep?level=1", "/wake_up"):
                reply = await client.post(f"http://127.0.0.1:{server.port}{path}")
                reply.raise_for_status()
    await load(server.port, 4, 1, None)  # warm-up


async def measured(a: argparse.Namespace, server: Server) -> Json:
    """One steady load's figures, with the CPU seconds of the server's processes (vLLM's API
    server or the stage's worker, and the engine core below it) and of this client."""
    from bench.proc_account import account, snapshot

    before, mine = snapshot(server.proc.pid), snapshot(os.getpid(), tree=False)
    results = await load(server.port, a.clients, a.per_client, None)
    cpu = account(before, snapshot(server.proc.pid))
    client = account(mine, snapshot(os.getpid(), tree=False))["processes"][0]
    out = figures(results) | {"cpu": cpu, "client_cpu_cores": client["cores"]}
    print(server.name, {k: v for k, v in out.items() if k != "cpu"}, flush=True)
    for proc in cpu["processes"][:3]:
        print(f"  {proc['name']}: {proc['cores']} cores {proc['threads']}", flush=True)
    return out


async def profiled(a: argparse.Namespace, server: Server) -> Json:
    """The same load again (not counted) while py-spy samples the server's top process."""
    from bench.proc_account import Profile

    profile = Profile(a.py_spy, server.proc.pid, a.workdir / f"pyspy-{server.name}.txt")
    results = await load(server.port, a.clients, a.per_client, None)
    top = await asyncio.to_thread(profile.stop)
    return {"tokens_per_s": figures(results).get("tokens_per_s")} | top


async def alternate(a: argparse.Namespace, bare: Server, stage: Server) -> Json:
    """Both servers up on the GPU at once; ``--rounds`` steady loads of each, alternating
    (bare first in even rounds, the stage first in odd ones), so drift of the machine falls
    on both alike."""
    rounds: list[Json] = []
    for n in range(a.rounds):
        pair = (bare, stage) if n % 2 == 0 else (stage, bare)
        rounds.append({s.name.split("-")[0]: await measured(a, s) for s in pair})
    out: Json = {"rounds": rounds}
    for side, server in (("bare", bare), ("stage", stage)):
        runs = [r[side] for r in rounds]
        out[side] = {
            k: round(statistics.median(r[k] for r in runs), 1)
            for k in ("tokens_per_s", "steady_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms")
        } | {"ready_s": round(server.ready_s, 1), "ok": sum(r["ok"] for r in runs),
             "requests": sum(r["requests"] for r in runs)}  # fmt: skip
        if a.py_spy:
            out[side]["profile"] = await profiled(a, server)
    return out


async def swapping(a: argparse.Namespace, server: Server, steady_figures: Json) -> Json:
    """The same load while the stage sleeps and wakes every ``--swap-every`` seconds."""
    swaps: list[Json] = []
    until = time.monotonic() + a.swap_seconds
    thread = swapper(server.grpc_port, a.swap_every, until, swaps)
    results = await load(server.port, a.clients, None, a.swap_seconds)
    thread.join(600)
    windows = between_swaps(results, swaps, a.settle)
    return figures(results) | {
        "swaps": swaps, "windows": windows, "settle_s": a.settle,
        "all_acks_ok": all(s["sleep_ok"] and s["wake_ok"] for s in swaps),
    }  # fmt: skip


def summarize(report: Json) -> Json:
    bare, stage = report["bare"], report["stage"]
    out: Json = {
        "vllm_64_clients_of_bare_serve": round(stage["tokens_per_s"] / bare["tokens_per_s"], 3),
        "steady_of_bare": round(stage["steady_tokens_per_s"] / bare["steady_tokens_per_s"], 3),
        "ttft_p50_of_bare": round(stage["ttft_p50_ms"] / bare["ttft_p50_ms"], 3),
        "throughput_goal_met": stage["tokens_per_s"] >= 0.95 * bare["tokens_per_s"],
        "ttft_goal_met": stage["ttft_p50_ms"] <= 1.10 * bare["ttft_p50_ms"],
    }
    if "rounds" in report:
        out["per_round_of_bare"] = [
            round(r["stage"]["tokens_per_s"] / r["bare"]["tokens_per_s"], 3)
            for r in report["rounds"]
        ]
    if "swaps" not in report:
        return out
    swaps = report["swaps"]
    steady = stage["steady_tokens_per_s"]
    rates = [w["tokens_per_s"] for w in swaps["windows"]]
    between = statistics.median(rates) if rates else 0.0
    return out | {
        "swaps": len(swaps["swaps"]),
        "swap_requests_lost": swaps["requests"] - swaps["ok"],
        "steady_tokens_per_s": steady,
        # the whole swap run (drains, sleeps and wakes included) against the steady run
        "swap_run_of_steady_run": round(swaps["tokens_per_s"] / stage["tokens_per_s"], 3),
        "between_swaps_tokens_per_s_median": round(between, 1),
        "between_swaps_of_steady": round(between / steady, 3) if steady else 0.0,
        "between_swaps_goal_met": bool(steady) and abs(between / steady - 1) <= 0.05,
        "nothing_lost": swaps["requests"] == swaps["ok"] and swaps["all_acks_ok"],
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vllmserve"))
    p.add_argument("--out", type=Path)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny, stand-in engine")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--per-client", type=int, default=4, help="requests per client (steps 1, 2)")
    p.add_argument("--swap-every", type=float, default=10.0)
    p.add_argument("--swap-seconds", type=float, default=120.0)
    p.add_argument("--settle", type=float, default=1.0, help="after a wake, not counted (s)")
    add_engine_arguments(p)
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="both servers up at once, this many alternating steady loads each",
    )
    p.add_argument("--py-spy", help="py-spy's path: profile one more load of each server")
    p.add_argument("--phases", nargs="+", choices=("bare", "stage"), default=["bare", "stage"])
    p.add_argument(
        "--bare-sleep-first",
        action="store_true",
        help="sleep and wake bare vLLM once before its load, as the stage's calibration does",
    )
    a = p.parse_args()
    if a.smoke:
        a.attention_backend = None
    a.workdir.mkdir(parents=True, exist_ok=True)
    report = asyncio.run(run(a))
    text = json.dumps(report, indent=1)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)
    print(json.dumps(report.get("summary", {}), indent=1))


if __name__ == "__main__":
    main()
