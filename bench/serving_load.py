"""The load of the serving benchmarks: streamed OpenAI completions from concurrent clients.

Each client sends streamed ``/v1/completions`` back to back from a fixed mix of prompt/output
lengths (prompts as token ids, ``ignore_eos``, greedy, so every length is exact); tokens are
counted from ``usage`` (``stream_options.include_usage``), TTFT is the time to the first
streamed text, and each streamed chunk's arrival is kept (token rates over any window).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

Json = dict[str, Any]
# (prompt tokens, output tokens): a fixed mix, cycled per request
MIX = ((128, 128), (512, 64), (64, 256), (256, 128))


@dataclass
class Result:
    ok: bool
    started: float
    ended: float
    ttft: float
    tokens: int
    wanted: int
    error: str = ""
    chunks: list[float] = field(default_factory=list)  # when each streamed token arrived


async def one_request(client: Any, port: int, n: int) -> Result:
    prompt_len, out_len = MIX[n % len(MIX)]
    prompt = [(n * 7919 + i * 31) % 250 for i in range(prompt_len)]  # byte tokens, no specials
    body = {"model": "llm", "prompt": prompt, "max_tokens": out_len, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    started = time.monotonic()
    ttft = -1.0
    tokens = 0
    chunks: list[float] = []
    try:
        async with client.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=600
        ) as reply:
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                return Result(False, started, time.monotonic(), -1, 0, out_len,
                              f"{reply.status_code} {text[:200]}")  # fmt: skip
            # SSE events end with a blank line; JSON escapes newlines, so b"\n" only separates
            # (text lines would also split at U+2028 and the like, which random text holds).
            buffer = b""
            async for data in reply.aiter_bytes():
                buffer += data
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    for line in event.split(b"\n"):
                        if not line.startswith(b"data: ") or line == b"data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if chunk.get("choices"):
                            now = time.monotonic()
                            chunks.append(now)
                            if ttft < 0:
                                ttft = now - started
                        if chunk.get("usage"):
                            tokens = int(chunk["usage"]["completion_tokens"])
    except Exception as exc:
        return Result(False, started, time.monotonic(), -1, 0, out_len, repr(exc)[:200])
    ended = time.monotonic()
    return Result(tokens == out_len, started, ended, ttft, tokens, out_len,
                  "" if tokens == out_len else f"{tokens} of {out_len} tokens", chunks)  # fmt: skip


async def load(
    port: int, clients: int, per_client: int | None, seconds: float | None
) -> list[Result]:
    """``clients`` concurrent clients, each ``per_client`` requests (or until ``seconds``)."""
    import httpx

    limits = httpx.Limits(max_connections=clients * 2, max_keepalive_connections=clients * 2)
    results: list[Result] = []
    counter = iter(range(10**9))
    stop_at = time.monotonic() + seconds if seconds is not None else None
    async with httpx.AsyncClient(limits=limits, timeout=600) as client:

        async def run_client() -> None:
            done = 0
            while (per_client is None or done < per_client) and (
                stop_at is None or time.monotonic() < stop_at
            ):
                results.append(await one_request(client, port, next(counter)))
                done += 1

        await asyncio.gather(*(run_client() for _ in range(clients)))
    return results


def token_rate(results: list[Result], lo: float, hi: float) -> float:
    """Tokens per second streamed in [lo, hi) (each chunk weighs its request's tokens per
    chunk: vLLM streams one chunk per engine step, one token each)."""
    tokens = 0.0
    for r in results:
        if r.ok and r.chunks:
            weight = r.tokens / len(r.chunks)
            tokens += weight * sum(1 for t in r.chunks if lo <= t < hi)
    return tokens / (hi - lo) if hi > lo else 0.0


def figures(results: list[Result]) -> Json:
    ok = [r for r in results if r.ok]
    if not ok:
        return {"requests": len(results), "ok": 0, "errors": [r.error for r in results[:5]]}
    t0 = min(r.started for r in results)
    t1 = max(r.ended for r in results)
    tokens = sum(r.tokens for r in ok)
    ttfts = sorted(r.ttft for r in ok if r.ttft >= 0)
    return {
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": [r.error for r in results if not r.ok][:5],
        "seconds": round(t1 - t0, 3), "output_tokens": tokens,
        "tokens_per_s": round(tokens / (t1 - t0), 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p95_ms": round(1000 * ttfts[int(0.95 * (len(ttfts) - 1))], 1),
        # the middle 60% of the run, away from the start and the tail as clients finish
        "steady_tokens_per_s": round(token_rate(ok, t0 + 0.2 * (t1 - t0), t1 - 0.2 * (t1 - t0)), 1),
    }  # fmt: skip
