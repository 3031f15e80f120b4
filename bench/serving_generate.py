"""The same weights without the worker, the figures ``bench/serving.py`` compares the stage with:
the model's batched ``generate`` and the worker's batcher driven in this process."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

from bench.serving_clients import Answer, prompt, tokens_in
from bench.serving_models import llm_config
from bench.serving_plan import Json, Plan
from bench.threads import run_threads
from bench.worker_grpc import ensure_tokenizer

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

        run_threads(count, loop)
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
