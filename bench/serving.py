"""A stage as a server: the real worker under concurrent clients against the same model batched.

On the GPU host's H100 (the exact command is in bench/results/README.md):

    python bench/serving.py --work /tmp/batching --out $OUT/serving.json

1. Builds a Llama-shaped causal LM of 16.6 GiB (bf16, random weights, from a config) and
   measures the same weights' batched ``model.generate`` (batch 1, 16, 64; 64 new tokens each,
   greedy, fixed lengths; the median of three calls) in this process, then frees it.
2. Starts the real ``omnistage-worker`` (AR runner, transformers, ``--max-batch 64``,
   OnDemand) with its OpenAI HTTP API, lets its host copy's page-locking (background start-up
   work) end, and drives it with 1, 16 and 64 concurrent HTTP clients
   (``/v1/completions``, ``max_tokens`` 64, greedy): tokens/s over a fixed window.
3. With 16 clients, a level-1 sleep and wake every ``--swap-every`` seconds through the gRPC
   SleepService for ``--swap-seconds``: every request answered, throughput between the swaps
   against the steady 16-client figure.
4. A small SD-like diffusers pipeline (built from configs) in a diffusion worker with
   ``--max-batch 8``: images/s at 1 and 8 concurrent same-size requests over gRPC.

Tokens are attributed to a window by each request's overlap with it (spread evenly over the
request's time generating; a request held during a sleep counts from the wake), so a window's
figure is not skewed by requests that straddle its edges. Random weights never pick the EOS
token in practice; each answer's token count is checked (``usage`` where the HTTP layer gives
it, else the word count of the word-level tokenizer's text).

``--smoke`` runs the same code on CPU with tiny models, short windows and fewer clients.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.reporting import emit  # noqa: E402
from bench.serving_generate import build_llm_and_measure_generate  # noqa: E402
from bench.serving_models import build_sd_like  # noqa: E402
from bench.serving_plan import GPU, SMOKE, Json, Plan, machine  # noqa: E402
from bench.serving_traffic import run_clients, run_images, run_swaps  # noqa: E402
from bench.serving_worker import settle, start_worker  # noqa: E402


def summarize(report: Json) -> Json:
    generate = report["llm"]["generate"]
    http = {str(r["clients"]): r for r in report["http"]}
    clients = sorted(http, key=int)
    middle, most = clients[len(clients) // 2], clients[-1]
    summary: Json = {
        "torch_tokens_per_s": {c: http[c]["tokens_per_s"] for c in clients},
        "generate_tokens_per_s": {b: g["tokens_per_s"] for b, g in generate.items()},
        "torch_16_clients_of_batched": http[middle]["tokens_per_s"]
        / generate[middle]["tokens_per_s"],
        f"torch_{most}_clients_of_batched": http[most]["tokens_per_s"]
        / generate[most]["tokens_per_s"],
        "all_http_answered": all(r["all_answered"] for r in report["http"]),
    }
    swaps = report.get("swaps")
    if swaps:
        summary["swaps"] = len(swaps["swaps"])
        summary["swaps_nothing_lost"] = swaps["nothing_lost"]
        summary["swaps_all_acks_ok"] = swaps["all_acks_ok"]
        summary["swaps_window_ratio_min"] = swaps["window_ratio_min"]
        summary["swaps_window_ratio_median"] = swaps["window_ratio_median"]
    images = report.get("images")
    if images:
        summary["images_per_s"] = {str(r["clients"]): r["images_per_s"] for r in images}
    return summary


def partial(report: Json, out: Path | None) -> None:
    """Write what is measured so far (a run cut short by a time limit still reports it)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".partial.json").write_text(json.dumps(report, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/batching"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="tiny models on CPU")
    parser.add_argument("--swap-seconds", type=float, default=None)
    parser.add_argument("--window", type=float, default=None, help="seconds per client figure")
    parser.add_argument("--no-images", action="store_true")
    args = parser.parse_args()
    plan = SMOKE if args.smoke else GPU
    if args.smoke:
        import torch

        torch.set_num_threads(1)
    if args.swap_seconds is not None:
        plan = Plan(**{**plan.__dict__, "swap_seconds": args.swap_seconds})
    if args.window is not None:
        plan = Plan(**{**plan.__dict__, "window_s": args.window})
    args.work.mkdir(parents=True, exist_ok=True)
    report: Json = {
        "smoke": args.smoke,
        "command": " ".join(sys.argv),
        "machine": machine(plan),
        "plan": plan.__dict__,
    }
    report["llm"] = build_llm_and_measure_generate(args.work, plan, args.smoke)
    partial(report, args.out)
    llm_dir = Path(report["llm"]["model_dir"])
    ar_log = args.work / "worker-ar.log"
    worker = start_worker(
        "ar", "transformers", llm_dir, plan, max_batch=plan.max_batch, log_path=ar_log
    )
    try:
        report["settle"] = settle(ar_log, 2.0 if args.smoke else 60.0)
        print(f"settled: {report['settle']}", flush=True)
        report["http"] = []
        for count in plan.clients:
            report["http"].append(run_clients(worker, count, plan))
            partial(report, args.out)
        report["worker_peak_active_bytes"] = worker.status().peak_active_bytes
        steady = next(r for r in report["http"] if r["clients"] == plan.clients[1])
        if plan.swap_seconds > 0:
            report["swaps"] = run_swaps(worker, plan.clients[1], plan, steady["tokens_per_s"])
            partial(report, args.out)
    finally:
        worker.stop()
    if not args.no_images:
        sd_dir = build_sd_like(args.work / "sd", args.smoke)
        images = start_worker("diffusion", "diffusers", sd_dir, plan, max_batch=8,
                              log_path=args.work / "worker-sd.log")  # fmt: skip
        try:
            report["images"] = [run_images(images, c, plan) for c in plan.image_clients]
        finally:
            images.stop()
    report["summary"] = summarize(report)
    emit(report, args.out)


if __name__ == "__main__":
    main()
