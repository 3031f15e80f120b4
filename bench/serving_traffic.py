"""The load ``bench/serving.py`` puts on a worker: HTTP clients over a window, the same clients
across sleeps and wakes, and concurrent image requests over gRPC."""

from __future__ import annotations

import statistics
import threading
import time
import uuid

import grpc

from bench.serving_clients import Clients, tokens_in
from bench.serving_plan import Json, Plan
from bench.serving_worker import Worker
from bench.threads import run_threads
from omnistage.worker.v1 import inference_service_pb2, sleep_service_pb2, types_pb2


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
    run_threads(count, client)
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
