"""The STAND-IN engine core: a child process holding memory on the simulated GPU.

Run as ``python -m vllm.engine_core`` by the stand-in ``LLM``; one JSON request per line on
stdin, one JSON answer per line on stdout; it exits when stdin closes (its parent died).

Physics, per vLLM's sleep mode (``CuMemAllocator`` tags "weights" and "kv_cache"):

- start: refuses when the device's free memory is below ``gpu_memory_utilization`` of its
  total (as vLLM does); takes its context (plus CUDA graphs unless ``enforce_eager``), the
  weights (the ``*.safetensors`` bytes) and a KV cache of what is left of its budget after an
  activation peak; no room for the cache is an error, as in vLLM;
- sleep level 1: the weights go to host memory, the KV cache is freed; level 2: the weights are
  discarded too; the context and graphs stay;
- wake_up(tags): maps the tagged memory again and can run out of memory (the simulated GPU's
  ``OutOfMemory``); weights woken from level 2 are garbage until ``reload_weights`` reads the
  files again (generation with them gives other tokens);
- generate: greedy token ids from the prompt ids and a digest of the weight files' bytes; the
  simulated GPU's ``slow_serving_s`` fault makes a request take that long (a drain to wait for).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import psutil

from tests.fakegpu import model
from tests.fakegpu.device import FakeGpu

GRAPH_FRACTION = 0.25  # CUDA graphs held beside the context unless enforce_eager
MODULUS = 2**31


def weights_digest(model_dir: Path) -> int:
    """A digest of the weight files' bytes (what a reload reads again)."""
    h = hashlib.sha256()
    for path in sorted(model_dir.glob("*.safetensors")):
        h.update(path.read_bytes())
    return int.from_bytes(h.digest()[:4], "little")


def greedy(digest: int, prompt: list[int], max_tokens: int, vocab: int) -> list[int]:
    """The stand-in model: a deterministic function of its weights and the prompt."""
    x = digest
    for token in prompt:
        x = (x * 1103515245 + token + 12345) % MODULUS
    out = []
    for _ in range(max_tokens):
        x = (x * 1103515245 + 12345) % MODULUS
        out.append(x % vocab)
    return out


class EngineCore:
    """The engine's memory on the simulated GPU, as one process record."""

    def __init__(self, init: dict[str, Any]) -> None:
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

    def _others(self) -> list[model.Proc]:
        return [p for pid, p in self.gpu.live().items() if pid != self.me.pid]

    def _publish(self, me: model.Proc) -> None:
        self.gpu.publish(me)
        self.me = me

    def sleep(self, level: int) -> None:
        with self.gpu.locked():
            self._publish(replace(self.me, weights=0, pool=0))
        if level == 2:
            self.valid = False
        self.level = max(self.level, level)

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

    def reload_weights(self) -> None:
        if self.me.weights == 0:
            raise RuntimeError("reload_weights: the weight memory is not mapped (wake it first)")
        self.digest = weights_digest(self.model_dir)
        self.valid = True

    def generate(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        if not (self.me.weights and self.me.pool):
            raise RuntimeError("the engine is sleeping: wake_up() before generate")
        digest = self.digest if self.valid else 0
        slow = self.gpu.faults(self.me.pid).slow_serving_s  # the simulated GPU's fault switch
        if slow > 0:
            time.sleep(slow)
        return [greedy(digest, p, max_tokens, self.vocab) for p in prompts]

    def handle(self, req: dict[str, Any]) -> Any:
        op = req["op"]
        if op == "sleep":
            return self.sleep(int(req["level"]))
        if op == "wake_up":
            return self.wake_up(req.get("tags"))
        if op == "reload_weights":
            return self.reload_weights()
        if op == "generate":
            return self.generate(req["prompts"], int(req["max_tokens"]))
        if op == "state":
            return {"level": self.level, "used": self.me.used, "pid": self.me.pid}
        raise ValueError(f"unknown op {op!r}")


def _answer(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main() -> None:
    """Serve requests until stdin closes."""
    try:
        core = EngineCore(json.loads(sys.stdin.readline()))
    except Exception as exc:
        _answer(ok=False, type=type(exc).__name__, error=str(exc))
        return
    _answer(ok=True, result={"pid": core.me.pid, "kv_bytes": core.kv})
    for line in sys.stdin:
        try:
            result = core.handle(json.loads(line))
        except Exception as exc:
            _answer(ok=False, type=type(exc).__name__, error=str(exc))
        else:
            _answer(ok=True, result=result)


if __name__ == "__main__":
    main()
