"""The STAND-IN engine core: a child process that batches requests and holds memory on the
simulated GPU.

Run as ``python -m vllm.engine_core`` by the stand-in ``AsyncLLM``. Lines of JSON both ways:
the first line in is the engine's configuration (answered once: started, or why not); then
``{"call": n, "op": ...}`` utility calls (answered ``{"call": n, "ok": ...}``) and
``{"op": "add" | "abort", ...}`` requests; out come ``{"out": [[id, [token], finish], ...],
"batch": n}`` after each step. It exits when stdin closes (its parent died).

Physics, per vLLM 0.24's V1 engine core and sleep mode (``CuMemAllocator`` tags "weights" and
"kv_cache"):

- start: refuses when the device's free memory is below ``gpu_memory_utilization`` of its
  total; takes its context (plus CUDA graphs unless ``enforce_eager``), the weights (the
  ``*.safetensors`` bytes) and a KV cache of what is left of its budget after an activation
  peak; no room for the cache is an error, as in vLLM;
- continuous batching: a scheduler step runs every request admitted so far (at most
  ``max_num_seqs``, and only while the KV cache has blocks for prompt + max tokens), each gets
  one token per step, and a step takes ``step_s`` whatever the batch (a decode step is bound by
  reading the weights); new requests join at the next step; the simulated GPU's
  ``slow_serving_s`` fault is added to every step;
- sleep(level, mode): pauses the scheduler (``abort``: the running and waiting requests end
  with finish reason "abort", as vLLM's default; ``wait``: sleeps once they finished), then
  level 1 moves the weights to host memory and frees the KV cache; level 2 discards the weights
  too; the context and graphs stay. Requests added while asleep wait (the scheduler is paused);
- wake_up(tags): maps the tagged memory again and can run out of memory (the simulated GPU's
  ``OutOfMemory``); scheduling resumes once everything is mapped; weights woken from level 2
  are garbage until ``reload_weights`` reads the files again (other tokens come out);
- tokens: a deterministic function of the weight files' digest, the prompt, the position and
  the request's seed (so one request's tokens never depend on what else is in the batch).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import queue
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import psutil

from tests.fakegpu import model
from tests.fakegpu.device import FakeGpu

GRAPH_FRACTION = 0.25  # CUDA graphs held beside the context unless enforce_eager
KV_BYTES_PER_TOKEN = 64  # the stand-in model's KV cache per token (all layers)
MODULUS = 2**31


def weights_digest(model_dir: Path) -> int:
    """A digest of the weight files' bytes (what a reload reads again)."""
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.read_bytes())
    return int.from_bytes(h.digest()[:4], "little")


def prompt_state(digest: int, prompt: list[int], seed: int) -> int:
    x = (digest + seed * 7919) % MODULUS
    for token in prompt:
        x = (x * 1103515245 + token + 12345) % MODULUS
    return x


def next_token(x: int, vocab: int) -> tuple[int, int]:
    x = (x * 1103515245 + 12345) % MODULUS
    return x, x % vocab


@dataclass
class Request:
    id: str
    prompt: list[int]
    max_tokens: int
    seed: int
    state: int = 0
    generated: int = 0
    blocks: int = 0  # KV tokens reserved


@dataclass
class Scheduler:
    """Waiting and running requests against the KV cache's capacity (in tokens)."""

    max_num_seqs: int
    kv_tokens: int
    waiting: deque[Request] = field(default_factory=deque)
    running: list[Request] = field(default_factory=list)
    used: int = 0

    def admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            need = len(self.waiting[0].prompt) + self.waiting[0].max_tokens
            if self.used + need > self.kv_tokens and self.running:
                return  # waits for blocks to free up
            req = self.waiting.popleft()
            req.blocks = need
            self.used += need
            self.running.append(req)

    def finish(self, req: Request) -> None:
        self.running.remove(req)
        self.used -= req.blocks

    def remove(self, request_id: str) -> Request | None:
        for req in list(self.running):
            if req.id == request_id:
                self.finish(req)
                return req
        for req in list(self.waiting):
            if req.id == request_id:
                self.waiting.remove(req)
                return req
        return None

    def all(self) -> list[Request]:
        return [*self.running, *self.waiting]


def extension(qualname: str) -> Any:
    """The worker extension, imported by its qualified name as vLLM's worker does (its
    methods are what ``collective_rpc`` calls besides the worker's own); None if not given."""
    if not qualname:
        return None
    module, _, name = qualname.rpartition(".")
    return getattr(importlib.import_module(module), name)()


class EngineCore:
    """The engine's memory on the simulated GPU, as one process record, and its scheduler."""

    def __init__(self, init: dict[str, Any]) -> None:
        # imported before the worker is built, as vLLM's WorkerWrapperBase.init_worker does
        self.extension = extension(str(init.get("worker_extension_cls") or ""))
        self.gpu = FakeGpu(Path(os.environ["OMNISTAGE_FAKE_GPU"]))
        self.device = self.gpu.device()
        self.model_dir = Path(init["model"])
        config = json.loads((self.model_dir / "config.json").read_text())
        self.vocab = int(config["vocab_size"])
        self.weights = sum(p.stat().st_size for p in self.model_dir.glob("*.safetensors"))
        pid = os.getpid()
        self.me = model.Proc(pid, psutil.Process(pid).create_time())
        self.digest = weights_digest(self.model_dir)
        self.valid = True
        self.level = 0
        self.paused = False
        self.added_while_asleep = 0  # requests that reached the engine while it slept
        self.step_s = float(init["step_s"])
        util = float(init["gpu_memory_utilization"])
        graphs = 0 if init.get("enforce_eager") else int(self.device.context * GRAPH_FRACTION)
        budget = int(util * self.device.total)
        with self.gpu.locked():
            others = self._others()
            free = model.free(self.device, [self.me, *others])
            if budget > free:
                raise ValueError(
                    f"Free memory on device ({free}/{self.device.total} bytes) on startup is "
                    f"less than desired GPU memory utilization ({util}, {budget} bytes). "
                    "Decrease GPU memory utilization or reduce GPU memory used by other "
                    "processes."
                )
            me = model.touch(self.device, self.me, others)
            model.grow(self.device, me, others, graphs + self.weights)
            me = replace(me, context=me.context + graphs, weights=self.weights)
            peak = self.device.activation_bytes(self.weights)
            self.kv = budget - me.context - self.weights - peak
            if self.kv <= 0:
                raise ValueError(
                    "No available memory for the cache blocks. Try increasing "
                    "`gpu_memory_utilization` when initializing the engine."
                )
            model.grow(self.device, me, others, self.kv)
            self._publish(replace(me, pool=self.kv))
        self.scheduler = Scheduler(int(init["max_num_seqs"]), self.kv // KV_BYTES_PER_TOKEN)

    def _others(self) -> list[model.Proc]:
        return [p for pid, p in self.gpu.live().items() if pid != self.me.pid]

    def _publish(self, me: model.Proc) -> None:
        self.gpu.publish(me)
        self.me = me

    @property
    def awake(self) -> bool:
        return bool(self.me.weights and self.me.pool) and not self.paused

    # -- utility calls ----------------------------------------------------------------------

    def sleep(self, level: int, mode: str) -> list[list[Any]]:
        """Pause, deal with the requests per ``mode``, free the memory; the aborted outputs."""
        self.paused = True
        aborted: list[list[Any]] = []
        if mode == "abort":
            for req in self.scheduler.all():
                self.scheduler.remove(req.id)
                aborted.append([req.id, [], "abort"])
        elif mode == "wait":
            while self.scheduler.running:
                self.paused = False
                self.step()
                self.paused = True
        with self.gpu.locked():
            self._publish(replace(self.me, weights=0, pool=0))
        if level == 2:
            self.valid = False
        self.level = max(self.level, level)
        return aborted

    def wake_up(self, tags: list[str] | None) -> None:
        wanted = ["weights", "kv_cache"] if tags is None else tags
        with self.gpu.locked():
            others = self._others()
            if "weights" in wanted and self.me.weights == 0:
                model.grow(self.device, self.me, others, self.weights)  # may raise OutOfMemory
                self._publish(replace(self.me, weights=self.weights))
            if "kv_cache" in wanted and self.me.pool == 0:
                model.grow(self.device, self.me, others, self.kv)
                self._publish(replace(self.me, pool=self.kv))
        if self.me.weights and self.me.pool:
            self.level = 0
            self.paused = False  # scheduling resumes once everything is resident

    def reload_weights(self) -> None:
        if self.me.weights == 0:
            raise RuntimeError("reload_weights: the weight memory is not mapped (wake it first)")
        self.digest = weights_digest(self.model_dir)
        self.valid = True

    def call(self, op: str, req: dict[str, Any]) -> Any:
        if op == "sleep":
            return self.sleep(int(req["level"]), str(req.get("mode", "abort")))
        if op == "wake_up":
            return self.wake_up(req.get("tags"))
        if op == "reload_weights":
            return self.reload_weights()
        if op == "reset_prefix_cache":
            return True
        if op == "is_sleeping":
            return self.paused or not (self.me.weights and self.me.pool)
        if op == "extension" and self.extension is not None:
            return getattr(self.extension, str(req["method"]))(*req["args"], **req["kwargs"])
        if op == "state":  # the stand-in's own introspection, for tests
            return {"level": self.level, "used": self.me.used, "pid": self.me.pid,
                    "added_while_asleep": self.added_while_asleep}  # fmt: skip
        raise ValueError(f"unknown op {op!r}")

    # -- requests -----------------------------------------------------------------------------

    def add(self, req: dict[str, Any]) -> None:
        prompt = [int(t) for t in req["prompt"]]
        seed = int(req.get("seed") or 0)
        digest = self.digest if self.valid else 0
        self.scheduler.waiting.append(
            Request(
                req["id"],
                prompt,
                int(req["max_tokens"]),
                seed,
                state=prompt_state(digest, prompt, seed),
            )
        )

    def step(self) -> tuple[list[list[Any]], int]:
        """One scheduler step: every running request gets one token; (outputs, batch size)."""
        self.scheduler.admit()
        batch = list(self.scheduler.running)
        if not batch:
            return [], 0
        slow = self.gpu.faults(self.me.pid).slow_serving_s
        time.sleep(self.step_s + slow)
        outs: list[list[Any]] = []
        for req in batch:
            req.state, token = next_token(req.state, self.vocab)
            req.generated += 1
            done = req.generated >= req.max_tokens
            if done:
                self.scheduler.finish(req)
            outs.append([req.id, [token], "length" if done else None])
        return outs, len(batch)


def _write(lock: threading.Lock, fields: dict[str, Any]) -> None:
    with lock:
        sys.stdout.write(json.dumps(fields) + "\n")
        sys.stdout.flush()


def _reader(inbox: queue.Queue[dict[str, Any] | None]) -> None:
    for line in sys.stdin:
        inbox.put(json.loads(line))
    inbox.put(None)


def main() -> None:
    """Serve until stdin closes."""
    lock = threading.Lock()
    try:
        core = EngineCore(json.loads(sys.stdin.readline()))
    except Exception as exc:
        _write(lock, {"ok": False, "type": type(exc).__name__, "error": str(exc)})
        return
    _write(lock, {"ok": True, "result": {"pid": core.me.pid, "kv_bytes": core.kv}})
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=_reader, args=(inbox,), daemon=True).start()
    while True:
        busy = core.awake and bool(core.scheduler.all())
        try:
            msg = inbox.get_nowait() if busy else inbox.get()
        except queue.Empty:
            msg = {}
        if msg is None:
            return
        op = msg.get("op")
        if op == "add":
            if not core.awake:
                core.added_while_asleep += 1
            core.add(msg)
        elif op == "abort":
            if core.scheduler.remove(str(msg["id"])) is not None:
                _write(lock, {"out": [[msg["id"], [], "abort"]], "batch": 0})
        elif op is not None:
            try:
                result = core.call(op, msg)
            except Exception as exc:
                _write(lock, {"call": msg["call"], "ok": False, "type": type(exc).__name__,
                              "error": str(exc)})  # fmt: skip
            else:
                if op == "sleep" and result:
                    _write(lock, {"out": result, "batch": 0})
                    result = None
                _write(lock, {"call": msg["call"], "ok": True, "result": result})
        if not inbox.empty():
            continue  # take every message that arrived before running the next step
        if core.awake:
            outs, batch = core.step()
            if outs:
                _write(lock, {"out": outs, "batch": batch})


if __name__ == "__main__":
    main()
