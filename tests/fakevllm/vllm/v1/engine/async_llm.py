"""STAND-IN of ``vllm.v1.engine.async_llm.AsyncLLM``: the async engine client.

As vLLM's, it starts its engine core in a child process (:mod:`vllm.engine_core`) while it is
constructed (blocking; it may be built off the event loop and used on it later), detokenizes
and checks stop strings in this process, and streams ``RequestOutput`` per request from one
output handler. ``sleep``, ``wake_up``, ``collective_rpc("reload_weights")``,
``reset_prefix_cache`` and ``is_sleeping`` are the engine core's utility calls.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

from vllm import CompletionOutput, RequestOutput, RequestOutputKind, SamplingParams
from vllm.usage.usage_lib import UsageContext

STEP_S_ENV = "OMNISTAGE_STANDIN_STEP_S"  # the stand-in's scheduler step time (seconds)
DEFAULT_STEP_S = 0.02


class EngineError(RuntimeError):
    """An error the engine core raised (its type name and message)."""


def load_tokenizer(model_dir: Path) -> Any:
    """The model directory's ``tokenizer.json`` (real ``tokenizers`` library), or None."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


class _Stream:
    """One request's outputs as the engine core delivers them (on the event loop)."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[tuple[list[int], str | None]] = asyncio.Queue()


class AsyncLLM:
    """The stand-in async engine client."""

    def __init__(self, vllm_config: Any, log_stats: bool = False, **_: Any) -> None:
        self.vllm_config = vllm_config
        self.model_config = vllm_config.model_config
        args = vllm_config.engine_args
        self.model_dir = Path(self.model_config.model)
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(self.model_dir)
        if not args.skip_tokenizer_init and self.tokenizer is None:
            raise OSError(f"Can't load tokenizer for '{self.model_dir}' (no tokenizer.json)")
        self.sleep_mode = bool(args.enable_sleep_mode)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.engine_core"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        init = {
            "model": str(self.model_dir),
            "gpu_memory_utilization": float(args.gpu_memory_utilization),
            "enforce_eager": bool(args.enforce_eager),
            "max_num_seqs": vllm_config.scheduler_config.max_num_seqs,
            "step_s": float(os.environ.get(STEP_S_ENV, DEFAULT_STEP_S)),
            "worker_extension_cls": vllm_config.parallel_config.worker_extension_cls,
        }
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._proc.stdin.write(json.dumps(init) + "\n")
        self._proc.stdin.flush()
        line = self._proc.stdout.readline()
        answer = json.loads(line) if line else {"ok": False, "type": "EngineDead", "error": ""}
        if not answer["ok"]:
            self._proc.wait(10)
            raise EngineError(f"{answer['type']}: {answer['error']}")
        self.engine = answer["result"]
        self._write_lock = threading.Lock()
        self._calls: dict[int, concurrent.futures.Future[Any]] = {}
        self._ids = itertools.count()
        self._streams: dict[str, _Stream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self.last_batch = 0
        self.errored = False
        threading.Thread(target=self._read, daemon=True, name="standin-output").start()

    @classmethod
    def from_vllm_config(
        cls, vllm_config: Any, usage_context: UsageContext = UsageContext.ENGINE_CONTEXT,
        disable_log_stats: bool = False, **kwargs: Any,
    ) -> AsyncLLM:  # fmt: skip
        return cls(vllm_config, log_stats=not disable_log_stats)

    @property
    def engine_pid(self) -> int:
        return int(self._proc.pid)

    # -- the child's output -----------------------------------------------------------------

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            if "call" in msg:
                future = self._calls.pop(int(msg["call"]))
                if msg["ok"]:
                    future.set_result(msg["result"])
                else:
                    future.set_exception(EngineError(f"{msg['type']}: {msg['error']}"))
            elif "out" in msg and self._loop is not None:
                self._loop.call_soon_threadsafe(self._deliver, msg["out"], int(msg["batch"]))
        self.errored = True
        for future in self._calls.values():
            future.set_exception(EngineError("engine core died"))

    def _deliver(self, outs: list[list[Any]], batch: int) -> None:
        if batch:
            self.last_batch = batch
        for request_id, tokens, finish in outs:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.queue.put_nowait((tokens, finish))

    def _send(self, msg: dict[str, Any]) -> None:
        if self._proc.poll() is not None:
            raise EngineError(f"engine core died (exit {self._proc.poll()})")
        assert self._proc.stdin is not None
        with self._write_lock:
            self._proc.stdin.write(json.dumps(msg) + "\n")
            self._proc.stdin.flush()

    async def _call(self, op: str, **fields: Any) -> Any:
        self._loop = asyncio.get_running_loop()
        call = next(self._ids)
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._calls[call] = future
        self._send({"call": call, "op": op, **fields})
        return await asyncio.wrap_future(future)

    # -- requests -----------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("prompt text needs a tokenizer (skip_tokenizer_init is set)")
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else str(self.tokenizer.decode(ids))

    async def generate(
        self, prompt: Any, sampling_params: SamplingParams, request_id: str, **_: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        """Add the request (``n`` sequences) and yield its outputs as they are generated."""
        self._loop = asyncio.get_running_loop()
        if self.errored:
            raise EngineError("EngineDeadError: the engine core died")
        text: str | None = None
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            ids = [int(t) for t in prompt["prompt_token_ids"]]
        elif isinstance(prompt, dict) and "prompt" in prompt:
            text, ids = prompt["prompt"], self.encode(prompt["prompt"])
        else:
            raise ValueError(f"unsupported prompt {type(prompt).__name__}")
        limit = int(self.model_config.max_model_len)
        if len(ids) >= limit:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model "
                f"length of {limit}. Make sure that `max_model_len` is no smaller than the "
                "number of text tokens."
            )
        params = sampling_params
        max_tokens = min(params.max_tokens or limit - len(ids), limit - len(ids))
        stops = [params.stop] if isinstance(params.stop, str) else list(params.stop or [])
        base_seed = params.seed if params.seed is not None and params.temperature > 0 else 0
        if params.temperature > 0 and params.seed is None:
            base_seed = int.from_bytes(os.urandom(4), "little")
        subs = [f"{i}_{request_id}" if params.n > 1 else request_id for i in range(params.n)]
        streams = {sub: _Stream() for sub in subs}
        self._streams.update(streams)
        outputs = [CompletionOutput(i, "", []) for i in range(params.n)]
        try:
            for i, sub in enumerate(subs):
                self._send({"op": "add", "id": sub, "prompt": ids, "max_tokens": max_tokens,
                            "seed": base_seed + i})  # fmt: skip
            pending = set(range(params.n))
            while pending:
                getters = {asyncio.ensure_future(streams[subs[i]].queue.get()): i for i in pending}
                done, rest = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                for fut in rest:
                    fut.cancel()
                for fut in done:
                    i = getters[fut]
                    tokens, finish = fut.result()
                    out = outputs[i]
                    out.token_ids = [*out.token_ids, *tokens]
                    if params.detokenize and self.tokenizer is not None:
                        out.text = self.decode(out.token_ids)
                    if not finish and stops:
                        hit = [(out.text.find(s), s) for s in stops if s in out.text]
                        if hit:
                            at, stop = min(hit)
                            out.text, finish = out.text[:at], "stop"
                            out.stop_reason = stop
                            self._send({"op": "abort", "id": subs[i]})
                    if finish:
                        out.finish_reason = finish
                        pending.discard(i)
                        self._streams.pop(subs[i], None)
                finished = not pending
                if params.output_kind is not RequestOutputKind.FINAL_ONLY or finished:
                    yield RequestOutput(
                        request_id, text, ids,
                        outputs=[CompletionOutput(o.index, o.text, list(o.token_ids),
                                                  finish_reason=o.finish_reason,
                                                  stop_reason=o.stop_reason) for o in outputs],
                        finished=finished,
                    )  # fmt: skip
        finally:
            for sub in subs:
                if self._streams.pop(sub, None) is not None:
                    self._send({"op": "abort", "id": sub})  # the caller went away

    async def abort(self, request_id: str | list[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self._send({"op": "abort", "id": rid})

    # -- utility calls ------------------------------------------------------------------------

    async def get_supported_tasks(self) -> tuple[str, ...]:
        return ("generate",)

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.sleep_mode:
            raise ValueError("Sleep mode is not enabled (enable_sleep_mode=True)")
        await self._call("sleep", level=level, mode=mode)

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._call("wake_up", tags=tags)

    async def is_sleeping(self) -> bool:
        return bool(await self._call("is_sleeping"))

    async def reset_prefix_cache(
        self, reset_running_requests: bool = False, reset_connector: bool = False
    ) -> bool:
        return bool(await self._call("reset_prefix_cache"))

    async def collective_rpc(
        self, method: str, timeout: float | None = None,  # noqa: ASYNC109 (vLLM's signature)
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:  # fmt: skip
        if method == "reload_weights" and not args and not kwargs:
            return [await self._call("reload_weights")]
        if self.vllm_config.parallel_config.worker_extension_cls:
            # a method of the worker extension (vLLM mixes it into its worker class)
            return [await self._call("extension", method=method, args=list(args),
                                     kwargs=kwargs or {})]  # fmt: skip
        raise NotImplementedError(
            "the stand-in knows collective_rpc('reload_weights') and the worker extension's "
            "methods only"
        )

    async def check_health(self) -> None:
        if self.errored or self._proc.poll() is not None:
            raise EngineError("EngineDeadError: the engine core died")

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the engine core (its memory goes with it)."""
        if self._proc.poll() is None:
            assert self._proc.stdin is not None
            with self._write_lock:
                self._proc.stdin.close()
            try:
                self._proc.wait(timeout or 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __del__(self) -> None:
        proc = getattr(self, "_proc", None)
        if proc is not None and proc.poll() is None:
            proc.kill()
