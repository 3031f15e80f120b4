"""The swaps of ``bench/serving_vllm.py``: a Sleep(1)+WakeUp over gRPC every few seconds while
the load runs, and the token rate in the windows between them."""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from typing import Any

from bench.serving_load import Result, token_rate

Json = dict[str, Any]


def swapper(grpc_port: int, every: float, until: float, out: list[Json]) -> threading.Thread:
    """A thread: Sleep(1) then WakeUp over gRPC every ``every`` seconds until ``until``."""
    import grpc

    from omnistage.worker.v1 import sleep_service_pb2, sleep_service_pb2_grpc, types_pb2

    LEVEL_1 = types_pb2.SleepLevel.ValueType(1)

    def run() -> None:
        stub = sleep_service_pb2_grpc.SleepServiceStub(
            grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        )
        next_at = time.monotonic() + every
        while next_at < until:
            time.sleep(max(0.0, next_at - time.monotonic()))
            began = time.monotonic()
            request = sleep_service_pb2.SleepRequest(task_id=uuid.uuid4().hex, level=LEVEL_1)
            slept = stub.Sleep(request, timeout=600).ack
            asleep = time.monotonic()
            woke = stub.WakeUp(sleep_service_pb2.WakeUpRequest(task_id=uuid.uuid4().hex),
                               timeout=600).ack  # fmt: skip
            ended = time.monotonic()
            out.append({
                "began": began, "asleep": asleep, "ended": ended,
                "sleep_ok": slept.ok, "wake_ok": woke.ok, "error": slept.error or woke.error,
                "drain_s": slept.drain_duration.ToTimedelta().total_seconds(),
                "sleep_s": asleep - began, "wake_s": ended - asleep,
                "freed_bytes": slept.freed_bytes, "used_after_sleep": slept.used_after_bytes,
            })  # fmt: skip
            next_at += every

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def between_swaps(results: list[Result], swaps: list[Json], settle: float) -> list[Json]:
    """Tokens per second streamed in each window between swaps (from ``settle`` after a wake
    to the next swap's start)."""
    windows = []
    edges = [(min(r.started for r in results), swaps[0]["began"])] if swaps else []
    for a, b in itertools.pairwise(swaps):
        edges.append((a["ended"] + settle, b["began"]))
    for lo, hi in edges:
        if hi - lo < 1.0:
            continue
        rate = token_rate(results, lo, hi)
        windows.append({"from": lo, "to": hi, "tokens_per_s": round(rate, 1)})
    return windows
