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
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

import grpc  # noqa: E402

from bench.reporting import emit  # noqa: E402
from bench.serving_clients import Answer, Clients, prompt, tokens_in  # noqa: E402
from bench.serving_models import build_sd_like, llm_config  # noqa: E402
from bench.worker_grpc import ensure_tokenizer, free_port  # noqa: E402
from omnistage.worker.v1 import (  # noqa: E402
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)

Json = dict[str, Any]
GiB = 1024**3


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (the GPU run or the CPU smoke run)."""

    device: str
    dtype: str
    new_tokens: int
    clients: tuple[int, ...]
    generate_batches: tuple[int, ...]
    window_s: float
    warmup_s: float
    swap_seconds: float
    swap_every: float
    max_batch: int
    image_side: int
    image_steps: int
    image_clients: tuple[int, ...]
    image_requests: int


GPU = Plan("cuda", "bfloat16", 64, (1, 16, 64), (1, 16, 64), 15.0, 3.0, 120.0, 10.0, 64,
           512, 20, (1, 8), 24)  # fmt: skip
SMOKE = Plan("cpu", "float32", 8, (1, 4, 8), (1, 4, 8), 2.0, 0.5, 3.0, 1.0, 8,
             32, 4, (1, 4), 4)  # fmt: skip


# -- models -----------------------------------------------------------------------------------


GENERATE_RUNS = 3
"""Timed ``generate`` calls per batch size (the median counts): on the lent H200 one call's
time varied by up to a quarter between runs of the same hour (bench/results/README.md)."""


def build_llm_and_measure_generate(work: Path, plan: Plan, smoke: bool) -> Json:
    """Build (or reuse) the model, save it, and time its batched ``generate`` here."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    model_dir = work / "llm"
    device = torch.device(plan.device)
    dtype = getattr(torch, plan.dtype)
    torch.manual_seed(0)
    started = time.monotonic()
    model: Any
    if (model_dir / "config.json").exists():
        model = LlamaForCausalLM.from_pretrained(model_dir, dtype=dtype)
        model.to(device)
        built = False
    else:
        torch.set_default_dtype(dtype)
        with device:
            model = LlamaForCausalLM(llm_config(smoke))
        torch.set_default_dtype(torch.float32)
        model.save_pretrained(model_dir, max_shard_size="4GB")
        built = True
    ensure_tokenizer(model_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    out: Json = {
        "model_dir": str(model_dir),
        "weights_bytes": weights,
        "built": built,
        "build_or_load_seconds": time.monotonic() - started,
        "generate": {},
    }
    for batch in plan.generate_batches:
        encoded = tokenizer([prompt(i) for i in range(batch)], return_tensors="pt").to(device)
        kwargs = {
            "max_new_tokens": plan.new_tokens,
            "min_new_tokens": plan.new_tokens,
            "do_sample": False,
            "pad_token_id": tokenizer.pad_token_id,
        }
        runs = []
        with torch.inference_mode():
            model.generate(**encoded, **kwargs)  # warm
            for _ in range(GENERATE_RUNS):
                sync(device)
                began = time.perf_counter()
                output = model.generate(**encoded, **kwargs)
                sync(device)
                runs.append(time.perf_counter() - began)
        seconds = statistics.median(runs)
        tokens = int((output.shape[1] - encoded["input_ids"].shape[1]) * batch)
        out["generate"][str(batch)] = {
            "seconds": seconds,
            "runs_seconds": runs,
            "tokens": tokens,
            "tokens_per_s": tokens / seconds,
        }
        print(f"generate batch {batch}: {tokens / seconds:.1f} tokens/s", flush=True)
    out["batcher_in_process"] = batcher_in_process(model, tokenizer, device, plan)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def batcher_in_process(model: Any, tokenizer: Any, device: Any, plan: Plan) -> Json:
    """The worker's batcher driven here, without the worker around it: one request, a batch
    submitted at once, and closed-loop threads (staggered arrivals), as tokens/s."""
    from omnistage.worker.v1 import inference_service_pb2 as pb
    from omnistage_worker.runners.decode_batch import DecodeBatcher, Job
    from omnistage_worker.runners.sampling import Sampling

    batcher = DecodeBatcher(
        model,
        tokenizer=tokenizer,
        device=device,
        max_batch=plan.max_batch,
        eos_ids=set(),
        pad_id=int(tokenizer.pad_token_id),
    )

    def job(index: int) -> Job:
        ids = [int(t) for t in tokenizer(prompt(index))["input_ids"]]
        return Job(pb.GenerateRequest(), ids, plan.new_tokens, Sampling(greedy=True), None)

    def together(count: int) -> float:
        began = time.perf_counter()
        futures = [batcher.submit(job(i)) for i in range(count)]
        tokens = sum(len(f.result().text.token_ids) for f in futures)
        return tokens / (time.perf_counter() - began)

    def closed_loop(count: int, seconds: float) -> float:
        done: list[tuple[float, float]] = []
        stop = time.monotonic() + seconds

        def loop(index: int) -> None:
            turn = 0
            while time.monotonic() < stop:
                began = time.monotonic()
                batcher.submit(job(index * 100 + turn)).result()
                done.append((began, time.monotonic()))
                turn += 1

        threads = [threading.Thread(target=loop, args=(i,)) for i in range(count)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        answers = [Answer(a, b, 200, plan.new_tokens) for a, b in done]
        start = min(a for a, _ in done) + plan.warmup_s
        return tokens_in(answers, start, stop) / (stop - start)

    def counters() -> tuple[int, int, int, float]:
        b = batcher
        return b.steps, b.row_steps, b.join_steps, b.step_seconds

    together(1)  # warm
    out: Json = {"one": together(1)}
    middle = plan.clients[1]
    together(middle)  # warm: the first batch of this size allocates its cache's blocks
    out[f"together_{middle}"] = together(middle)
    before = counters()
    out[f"closed_loop_{middle}"] = closed_loop(middle, plan.warmup_s + plan.window_s / 2)
    steps, rows, joins, seconds = (b - a for a, b in zip(before, counters(), strict=True))
    out[f"closed_loop_{middle}_steps"] = {
        "steps": steps,
        "mean_rows": rows / max(steps, 1),
        "join_steps": joins,
        "ms_per_step": 1000 * seconds / max(steps, 1),
    }
    out["steps"] = batcher.steps
    batcher.close()
    print(f"batcher in process: {out}", flush=True)
    return out


def sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


# -- the worker -------------------------------------------------------------------------------


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    http_port: int
    log_path: Path

    @property
    def sleep(self) -> Any:
        return sleep_service_pb2_grpc.SleepServiceStub(self.channel)

    @property
    def inference(self) -> Any:
        return inference_service_pb2_grpc.InferenceServiceStub(self.channel)

    def status(self) -> Any:
        return self.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def start_worker(runner: str, backend: str, model: Path, plan: Plan, *, max_batch: int,
                 log_path: Path, launcher: list[str] | None = None) -> Worker:  # fmt: skip
    """Spawn ``python -m omnistage_worker`` (or ``launcher`` + the worker's flags); return
    once it is Active."""
    port, http_port = free_port(), free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), env.get("PYTHONPATH", "")]
    )
    dtype = plan.dtype if runner == "ar" or plan.device == "cpu" else "float16"
    cmd = [
        *(launcher or [sys.executable, "-m", "omnistage_worker"]),
        f"--runner={runner}", f"--backend={backend}", f"--model={model}",
        f"--device={plan.device}", f"--dtype={dtype}", "--host=127.0.0.1",
        f"--port={port}", f"--http-port={http_port}", "--served-model-name=bench",
        f"--max-batch={max_batch}", "--activation=ondemand", "--hold-timeout=120",
    ]  # fmt: skip
    if plan.device == "cpu":
        cmd.append("--cpu-threads=1")  # a loaded small CPU: no oversubscribed thread pools
    log = log_path.open("wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    worker = Worker(proc, grpc.insecure_channel(f"127.0.0.1:{port}"), http_port, log_path)
    deadline = time.monotonic() + 900
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}: {tail(log_path)}")
        try:
            if worker.status().state == types_pb2.WORKER_STATE_ACTIVE:
                return worker
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"worker did not become Active: {tail(log_path)}")
        time.sleep(0.2)


PINNED = "page-locked in"
"""The worker's log line once its host copy is page-locked (engine/pinning.py, in the
background after Active, stepping aside for requests; about 4.3 s on an idle H200)."""


def settle(log_path: Path, within: float) -> Json:
    """Wait (at most ``within`` s) for the worker's start-up work in the background to end,
    so the client windows measure steady serving, not the start: what was waited is kept."""
    began = time.monotonic()
    while PINNED not in log_path.read_text(errors="replace"):
        if time.monotonic() - began > within:
            return {"host_copy_pinned": False, "waited_s": time.monotonic() - began}
        time.sleep(0.1)
    return {"host_copy_pinned": True, "waited_s": time.monotonic() - began}


def tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


# -- HTTP clients -----------------------------------------------------------------------------


def run_clients(worker: Worker, count: int, plan: Plan) -> Json:
    warm = Clients(worker.http_port, count, plan.new_tokens, rounds=1)
    warm.start()
    warm.finish()  # one request each, so shapes and kernels are warm before measuring
    clients = Clients(worker.http_port, count, plan.new_tokens)
    began = time.monotonic()
    clients.start()
    time.sleep(plan.warmup_s + plan.window_s)
    clients.finish()
    a, b = began + plan.warmup_s, began + plan.warmup_s + plan.window_s
    latencies = sorted(x.end - x.start for x in clients.answers)
    rate = tokens_in(clients.answers, a, b) / plan.window_s
    print(f"{count} HTTP clients: {rate:.1f} tokens/s", flush=True)
    return {
        "clients": count,
        "window_s": plan.window_s,
        "tokens_per_s": rate,
        "requests": len(clients.answers),
        "short_answers": sum(x.tokens != plan.new_tokens for x in clients.answers),
        "latency_p50_s": statistics.median(latencies) if latencies else None,
        "errors": clients.errors[:10],
        "all_answered": not clients.errors and all(x.status == 200 for x in clients.answers),
    }


def run_swaps(worker: Worker, count: int, plan: Plan, steady: float) -> Json:
    """``count`` clients while the worker sleeps and wakes every ``plan.swap_every`` s."""
    clients = Clients(worker.http_port, count, plan.new_tokens)
    began = time.monotonic()
    clients.start()
    time.sleep(plan.warmup_s)
    swaps: list[Json] = []
    wakes: list[float] = []
    windows: list[tuple[float, float]] = []
    window_start = time.monotonic()
    while time.monotonic() - began < plan.warmup_s + plan.swap_seconds:
        time.sleep(max(0.0, window_start + plan.swap_every - time.monotonic()))
        sleep_at = time.monotonic()
        windows.append((window_start, sleep_at))
        slept = worker.sleep.Sleep(
            sleep_service_pb2.SleepRequest(
                task_id=str(uuid.uuid4()), level=types_pb2.SLEEP_LEVEL_OFFLOAD
            ),
            timeout=600,
        ).ack
        woke = worker.sleep.WakeUp(
            sleep_service_pb2.WakeUpRequest(task_id=str(uuid.uuid4())), timeout=600
        ).ack
        window_start = time.monotonic()
        wakes.append(window_start)
        swaps.append(
            {
                "sleep_ok": slept.ok,
                "wake_ok": woke.ok,
                "drain_s": slept.drain_duration.ToNanoseconds() / 1e9,
                "sleep_s": slept.duration.ToNanoseconds() / 1e9,
                "wake_s": woke.duration.ToNanoseconds() / 1e9,
                "swap_s": window_start - sleep_at,
                "used_after_sleep_bytes": slept.used_after_bytes,
                "peak_active_bytes": slept.peak_active_bytes,
                "error": slept.error or woke.error,
            }
        )
    clients.finish()

    def resumed(end: float) -> float:
        return max((w for w in wakes if w < end), default=0.0)

    rates = [tokens_in(clients.answers, a, b, resumed) / (b - a) for a, b in windows]
    between = rates[1:] or rates  # the first window began before the first wake
    ratios = [r / steady for r in between] if steady else []
    print(f"swaps: {len(swaps)}, between-swap tokens/s {[round(r) for r in between]}", flush=True)
    return {
        "clients": count,
        "swap_every_s": plan.swap_every,
        "seconds": plan.swap_seconds,
        "swaps": swaps,
        "requests": len(clients.answers),
        "short_answers": sum(x.tokens != plan.new_tokens for x in clients.answers),
        "errors": clients.errors[:10],
        "nothing_lost": not clients.errors and all(x.status == 200 for x in clients.answers),
        "all_acks_ok": all(s["sleep_ok"] and s["wake_ok"] for s in swaps),
        "window_tokens_per_s": between,
        "window_ratio_to_steady": ratios,
        "window_ratio_min": min(ratios) if ratios else None,
        "window_ratio_median": statistics.median(ratios) if ratios else None,
    }


# -- diffusion ----------------------------------------------------------------------------------


def run_images(worker: Worker, count: int, plan: Plan) -> Json:
    """``count`` concurrent gRPC clients making ``plan.image_requests`` images in all."""
    sizes: list[int] = []
    errors: list[str] = []
    lock = threading.Lock()
    per_client = max(1, plan.image_requests // count)

    def client(index: int) -> None:
        for turn in range(per_client):
            request = inference_service_pb2.GenerateRequest(
                request_id=str(uuid.uuid4()),
                prompt="a cat on a mat",
                seed=index * 1000 + turn,
                height=plan.image_side,
                width=plan.image_side,
                num_inference_steps=plan.image_steps,
            )
            try:
                reply = worker.inference.Generate(request, timeout=600)
            except grpc.RpcError as exc:
                with lock:
                    errors.append(repr(exc))
                continue
            with lock:
                sizes.append(reply.batch_size)

    warm = threading.Thread(target=client, args=(999,))
    warm.start()
    warm.join()
    sizes.clear()
    began = time.monotonic()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - began
    print(f"{count} image clients: {len(sizes) / seconds:.2f} images/s", flush=True)
    return {
        "clients": count,
        "images": len(sizes),
        "seconds": seconds,
        "images_per_s": len(sizes) / seconds,
        "batch_sizes": {str(s): sizes.count(s) for s in sorted(set(sizes))},
        "errors": errors[:10],
    }


# -- the run ----------------------------------------------------------------------------------


def machine(plan: Plan) -> Json:
    import torch

    info: Json = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    import transformers

    info["transformers"] = transformers.__version__
    if plan.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


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
