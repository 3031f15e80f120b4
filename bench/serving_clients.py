"""Closed-loop HTTP clients of ``bench/serving.py`` and how their tokens are counted."""

from __future__ import annotations

import http.client
import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


def prompt(index: int) -> str:
    """A prompt of 16 words of the bench's word-level tokenizer."""
    return " ".join(f"w{10 + (index * 31 + j * 7) % 400}" for j in range(PROMPT_WORDS))


PROMPT_WORDS = 16


@dataclass
class Answer:
    """One HTTP request as a client saw it."""

    start: float
    end: float
    status: int
    tokens: int


@dataclass
class Clients:
    """Closed-loop HTTP clients: each sends its next request when its answer comes."""

    port: int
    count: int
    new_tokens: int
    rounds: int | None = None
    """Requests per client (None: until :meth:`finish`)."""
    stream: bool = False
    """Streamed completions (SSE, with the usage chunk) instead of whole answers."""
    stop: threading.Event = field(default_factory=threading.Event)
    answers: list[Answer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for index in range(self.count):
            thread = threading.Thread(target=self._loop, args=(index,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def finish(self) -> None:
        if self.rounds is None:
            self.stop.set()
        for thread in self._threads:
            thread.join(600)

    def _loop(self, index: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        turn = 0
        while not self.stop.is_set() and (self.rounds is None or turn < self.rounds):
            fields: dict[str, Any] = {
                "model": "bench",
                "prompt": prompt(index * 1000 + turn),
                "max_tokens": self.new_tokens,
                "temperature": 0,
            }
            if self.stream:
                fields.update(stream=True, stream_options={"include_usage": True})
            body = json.dumps(fields)
            began = time.monotonic()
            try:
                conn.request("POST", "/v1/completions", body, {"content-type": "application/json"})
                reply = conn.getresponse()
                raw = reply.read()
                data = last_event(raw) if self.stream and reply.status == 200 else json.loads(raw)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self.errors.append(f"client {index}: {exc!r}")
                conn.close()
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
                continue
            ended = time.monotonic()
            tokens = completion_tokens(data, self.new_tokens)
            if reply.status != 200:
                self.errors.append(f"client {index}: {reply.status} {str(data)[:200]}")
            self.answers.append(Answer(began, ended, reply.status, tokens))
            turn += 1
        conn.close()


def last_event(raw: bytes) -> Any:
    """The last JSON event of a server-sent event stream (its usage chunk when asked for)."""
    events = [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: {")]
    return json.loads(events[-1]) if events else None


def completion_tokens(data: Any, asked: int) -> int:
    """Tokens of a completions answer: ``usage`` when given; else ``asked`` when it finished
    for length (the worker counts its tokens for that), else the word count (every token of
    the bench's word-level tokenizer decodes to one word)."""
    if not isinstance(data, dict):
        return -1
    usage = data.get("usage")
    if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
        return int(usage["completion_tokens"])
    choice = (data.get("choices") or [{}])[0]
    if choice.get("finish_reason") == "length":
        return asked
    return len(str(choice.get("text", "")).split())


def tokens_in(answers: Sequence[Answer], a: float, b: float,
              resumed: Callable[[float], float] = lambda end: 0.0) -> float:  # fmt: skip
    """Tokens generated within [a, b]: each answer's tokens spread over its generating time
    (from its start, or from ``resumed(end)`` when it was held until a wake)."""
    total = 0.0
    for ans in answers:
        start = max(ans.start, resumed(ans.end))
        span = ans.end - start
        if span <= 0:
            continue
        overlap = min(b, ans.end) - max(a, start)
        if overlap > 0:
            total += ans.tokens * overlap / span
    return total
