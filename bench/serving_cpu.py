"""The torch AR stage's HTTP path against its own batcher, on CPU, in one run.

    python bench/serving_cpu.py --out bench/results/serving_cpu.json

On the GPU (bench/serving.py) a stage at 16 HTTP clients made 0.72-0.89 of the same batcher
driven by 16 threads in the bench process. This bench shows that gap without a GPU: a
Llama-shaped model built from a config (random weights, no downloads) with the GPU model's 36
layers but a tiny width, so a decode step (about 28 ms at 16 rows, single-threaded) is spent
the way the H200's is: in Python launching small operations, not in arithmetic. Then, with the
same weights and the same window:

1. ``model.generate`` at batch 1 and 16 (64 new tokens, greedy; the median of three);
2. the worker's batcher in this process, driven by 1 and N closed-loop threads (no HTTP);
3. the real worker (``bench/serving_probe.py`` around ``omnistage_worker``'s ``main``) with 1
   and N closed-loop HTTP clients, non-streamed and streamed (``/v1/completions``, usage).

Per window: tokens/s, and from inside the worker the batcher's steps (wall and in-step ms per
step, rows per step), the event loop's busy fraction, wake-ups and thread-safe hand-overs per
step, and each thread's CPU share. ``--smoke``: a tiny model and short windows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.reporting import emit  # noqa: E402
from bench.serving_clients import Answer, Clients, prompt, tokens_in  # noqa: E402
from bench.serving_generate import sync  # noqa: E402
from bench.serving_plan import Plan, machine  # noqa: E402
from bench.serving_probe import read_stats, thread_cpu  # noqa: E402
from bench.serving_worker import Worker, settle, start_worker  # noqa: E402
from bench.worker_grpc import ensure_tokenizer  # noqa: E402

Json = dict[str, Any]

LAYERS = 36
"""The GPU model's layer count (bench/serving_models.py): as many operations per step."""
FULL = Plan("cpu", "float32", 64, (1, 16), (1, 16), 12.0, 3.0, 0.0, 10.0, 64, 0, 0, (), 0)
SMOKE = Plan("cpu", "float32", 8, (1, 4), (1, 4), 1.5, 0.5, 0.0, 10.0, 8, 0, 0, (), 0)


def build(work: Path, smoke: bool) -> tuple[Any, Any]:
    """The model (built once, saved for the worker) and its tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    model_dir = work / ("llm-smoke" if smoke else "llm")
    if not (model_dir / "config.json").exists():
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=64 if smoke else 128,
            intermediate_size=128 if smoke else 256,
            num_hidden_layers=2 if smoke else LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        LlamaForCausalLM(config).save_pretrained(model_dir)
    ensure_tokenizer(model_dir)
    model: Any = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def generate_rates(model: Any, tokenizer: Any, plan: Plan) -> Json:
    """Batched ``generate`` tokens/s per batch size (the median of three calls)."""
    import torch

    out: Json = {}
    for batch in plan.generate_batches:
        encoded = tokenizer([prompt(i) for i in range(batch)], return_tensors="pt")
        kwargs = {"max_new_tokens": plan.new_tokens, "min_new_tokens": plan.new_tokens,
                  "do_sample": False, "pad_token_id": tokenizer.pad_token_id}  # fmt: skip
        runs = []
        with torch.inference_mode():
            model.generate(**encoded, **kwargs)
            for _ in range(3):
                began = time.perf_counter()
                model.generate(**encoded, **kwargs)
                sync(model.device)
                runs.append(time.perf_counter() - began)
        seconds = statistics.median(runs)
        out[str(batch)] = {"tokens_per_s": batch * plan.new_tokens / seconds,
                           "ms_per_step": 1000 * seconds / plan.new_tokens}  # fmt: skip
    return out


def batcher_rates(model: Any, tokenizer: Any, plan: Plan) -> Json:
    """The worker's batcher in this process, 1 and N closed-loop threads, one window each."""
    from omnistage.worker.v1 import inference_service_pb2 as pb
    from omnistage_worker.runners.decode_batch import DecodeBatcher, Job
    from omnistage_worker.runners.sampling import Sampling

    batcher = DecodeBatcher(model, tokenizer=tokenizer, device=model.device,
                            max_batch=plan.max_batch, eos_ids=set(),
                            pad_id=int(tokenizer.pad_token_id))  # fmt: skip

    def job(index: int) -> Job:
        ids = [int(t) for t in tokenizer(prompt(index))["input_ids"]]
        return Job(pb.GenerateRequest(), ids, plan.new_tokens, Sampling(greedy=True), None)

    def counters() -> Json:
        return {"t": time.monotonic(), "threads_cpu_s": thread_cpu(),
                "batcher": {"steps": batcher.steps, "row_steps": batcher.row_steps,
                            "join_steps": batcher.join_steps,
                            "step_seconds": batcher.step_seconds}}  # fmt: skip

    out: Json = {}
    for count in plan.clients:
        done: list[Answer] = []
        stop = threading.Event()

        def loop(index: int, stop: threading.Event, done: list[Answer]) -> None:
            turn = 0
            while not stop.is_set():
                began = time.monotonic()
                batcher.submit(job(index * 1000 + turn)).result()
                done.append(Answer(began, time.monotonic(), 200, plan.new_tokens))
                turn += 1

        threads = [threading.Thread(target=loop, args=(i, stop, done)) for i in range(count)]
        for thread in threads:
            thread.start()
        time.sleep(plan.warmup_s)
        a, first = time.monotonic(), counters()
        time.sleep(plan.window_s)
        b, last = time.monotonic(), counters()
        stop.set()
        for thread in threads:
            thread.join()
        rate = tokens_in(done, a, b) / (b - a)
        out[str(count)] = {"tokens_per_s": rate, **window_stats(first, last, rate)}
        print(f"batcher, {count} threads: {out[str(count)]}", flush=True)
    batcher.close()
    return out


def window_stats(first: Json, last: Json, tokens_per_s: float) -> Json:
    """What the counters (the batcher's, the threads' CPU, the worker's loop) say about the
    window between two reads.

    Wall figures on a shared CPU follow the machine's load; CPU seconds per token do not, and
    they are what a GPU step pays: there the decode thread is bound by the host (launching
    operations from Python) and every other thread's Python holds the same GIL, so the ratio
    ``decode / (decode + loop + lane)`` CPU bounds the stage against its batcher alone."""
    seconds = last["t"] - first["t"]
    out: Json = {"seconds": seconds}
    d = {k: last["batcher"][k] - first["batcher"][k] for k in first["batcher"]}
    steps = max(d["steps"], 1)
    out.update(steps=d["steps"], rows_per_step=d["row_steps"] / steps,
               join_steps=d["join_steps"], ms_per_step_in_step=1000 * d["step_seconds"] / steps,
               ms_per_step_wall=1000 * seconds / steps)  # fmt: skip
    tokens = max(tokens_per_s * seconds, 1.0)
    names = set(first["threads_cpu_s"]) | set(last["threads_cpu_s"])
    cpu = {n: last["threads_cpu_s"].get(n, 0.0) - first["threads_cpu_s"].get(n, 0.0) for n in names}
    out["cpu_ms_per_token"] = {n: round(1000 * v / tokens, 4) for n, v in sorted(cpu.items())}
    out["decode_cpu_ms_per_step"] = 1000 * cpu.get(DECODE, 0.0) / steps
    beside = sum(cpu.get(n, 0.0) for n in GIL_NEIGHBOURS)
    out["beside_decode_cpu_ms_per_token"] = 1000 * beside / tokens
    out["decode_share_of_gil_cpu"] = cpu.get(DECODE, 0.0) / max(cpu.get(DECODE, 0.0) + beside, 1e-9)
    if "loop_busy_s" in first:
        out["loop_busy_fraction"] = (last["loop_busy_s"] - first["loop_busy_s"]) / seconds
        out["loop_wakeups_per_step"] = (last["loop_wakeups"] - first["loop_wakeups"]) / steps
        calls = last["loop_threadsafe_calls"] - first["loop_threadsafe_calls"]
        out["loop_threadsafe_calls_per_step"] = calls / steps
    return out


DECODE = "omnistage-decode-batch"
GIL_NEIGHBOURS = ("MainThread", "omnistage-generate")
"""The worker's threads whose Python runs beside the decode thread's for every request: the
event loop (HTTP, the worker's request path) and the request lane."""


def http_rates(model_dir: Path, work: Path, plan: Plan) -> Json:
    """The real worker with 1 and N HTTP clients, whole and streamed answers."""
    stats = work / "worker-stats.json"
    log = work / "worker.log"
    probe = [sys.executable, str(REPO / "bench/serving_probe.py"), str(stats)]
    worker = start_worker("ar", "transformers", model_dir, plan, max_batch=plan.max_batch,
                          log_path=log, launcher=probe)  # fmt: skip
    out: Json = {}
    try:
        out["settle"] = settle(log, 2.0)
        for stream in (False, True):
            for count in plan.clients:
                key = f"{'stream' if stream else 'whole'}_{count}"
                out[key] = http_window(worker, stats, count, stream, plan)
                print(f"HTTP {key}: {out[key]}", flush=True)
    finally:
        worker.stop()
    return out


def http_window(worker: Worker, stats: Path, count: int, stream: bool, plan: Plan) -> Json:
    warm = Clients(worker.http_port, count, plan.new_tokens, rounds=1, stream=stream)
    warm.start()
    warm.finish()
    clients = Clients(worker.http_port, count, plan.new_tokens, stream=stream)
    clients.start()
    time.sleep(plan.warmup_s)
    a, first = time.monotonic(), read_stats(worker.proc.pid, stats)
    time.sleep(plan.window_s)
    b, last = time.monotonic(), read_stats(worker.proc.pid, stats)
    clients.finish()
    rate = tokens_in(clients.answers, a, b) / (b - a)
    return {
        "tokens_per_s": rate,
        "requests": len(clients.answers),
        "short_answers": sum(x.tokens != plan.new_tokens for x in clients.answers),
        "errors": clients.errors[:5],
        **window_stats(first, last, rate),
    }


def summarize(report: Json, plan: Plan) -> Json:
    n = str(plan.clients[-1])
    gen, batcher, http = report["generate"], report["batcher"], report["http"]
    summary: Json = {
        f"batcher_{n}_of_generate": batcher[n]["tokens_per_s"] / gen[n]["tokens_per_s"],
        "batcher_1_of_generate": batcher["1"]["tokens_per_s"] / gen["1"]["tokens_per_s"],
    }
    for kind in ("whole", "stream"):
        for count in (n, "1"):
            rate = http[f"{kind}_{count}"]["tokens_per_s"]
            summary[f"http_{kind}_{count}_of_batcher"] = rate / batcher[count]["tokens_per_s"]
            summary[f"http_{kind}_{count}_of_generate"] = rate / gen[count]["tokens_per_s"]
            window = http[f"{kind}_{count}"]
            summary[f"http_{kind}_{count}_decode_share_of_gil_cpu"] = window[
                "decode_share_of_gil_cpu"
            ]
    summary["all_answered"] = all(not w["errors"] for k, w in http.items() if k != "settle")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/serving_cpu"))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--window", type=float, default=None, help="seconds per figure")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)  # as the worker's --cpu-threads=1
    plan = SMOKE if args.smoke else FULL
    if args.window is not None:
        plan = Plan(**{**plan.__dict__, "window_s": args.window})
    args.work.mkdir(parents=True, exist_ok=True)
    report: Json = {"smoke": args.smoke, "command": " ".join(sys.argv),
                    "machine": machine(plan), "plan": plan.__dict__}  # fmt: skip
    model, tokenizer = build(args.work, args.smoke)
    report["model"] = {"layers": model.config.num_hidden_layers,
                       "hidden": model.config.hidden_size,
                       "parameters": sum(p.numel() for p in model.parameters())}  # fmt: skip
    report["generate"] = generate_rates(model, tokenizer, plan)
    print(f"generate: {report['generate']}", flush=True)
    report["batcher"] = batcher_rates(model, tokenizer, plan)
    model_dir = Path(model.name_or_path)
    del model
    report["http"] = http_rates(model_dir, args.work, plan)
    report["summary"] = summarize(report, plan)
    emit(report, args.out)


if __name__ == "__main__":
    main()
