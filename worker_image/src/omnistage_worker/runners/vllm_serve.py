"""vLLM's own OpenAI server over its async engine, built in the worker process (vLLM 0.24).

The same three steps as ``vllm serve`` (``vllm.entrypoints.openai.api_server``): the serve
flags parsed by vLLM's own parser, the ``AsyncLLM`` engine client from them, then vLLM's app
(``build_app``) and its state (``init_app_state``). :func:`serve_argv` is the one list of
flags for a stage, so a bare ``vllm serve`` with the same list runs the same engine
(``bench/serving_vllm.py`` does exactly that). :class:`LoopBridge` runs the engine client's
coroutines on the worker's event loop from the worker's lanes (the engine client belongs to
the loop that first awaits it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from omnistage_worker.config import ConfigError, WorkerConfig
from omnistage_worker.runners import vllm_forkserver

T = TypeVar("T")
log = logging.getLogger(__name__)

FAST_WAKE_EXTENSION = "omnistage_worker.runners.vllm_wake_cuda.WakeExtension"
"""vLLM's ``worker_extension_cls`` for the fast sleep and wake (imported in vLLM's worker)."""


def serve_argv(config: WorkerConfig, utilization: float, tokenizer: bool) -> list[str]:
    """The ``vllm serve`` flags of this stage (sleep mode on, ``spec.vllm``'s engine options)."""
    engine = config.vllm
    argv = [
        "--model", str(config.model),
        "--served-model-name", config.model_name,
        "--enable-sleep-mode",
        "--gpu-memory-utilization", repr(utilization),
        "--tensor-parallel-size", str(engine.tensor_parallel_size),
        "--seed", "0",
        "--disable-log-stats",
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if not tokenizer:
        argv.append("--skip-tokenizer-init")
    if engine.enforce_eager:
        argv.append("--enforce-eager")
    if engine.max_model_len is not None:
        argv += ["--max-model-len", str(engine.max_model_len)]
    if config.dtype != "auto":
        argv += ["--dtype", config.dtype]
    if engine.attention_backend is not None:
        argv += ["--attention-backend", engine.attention_backend]
    if engine.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", engine.kv_cache_dtype]
    for flag, value in (
        ("enable-prefix-caching", engine.enable_prefix_caching),
        ("enable-chunked-prefill", engine.enable_chunked_prefill),
    ):
        if value is not None:
            argv.append(f"--{flag}" if value else f"--no-{flag}")
    if engine.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if engine.fast_wake:
        argv += ["--worker-extension-cls", FAST_WAKE_EXTENSION]
    for flag, text in (
        ("tool-call-parser", engine.tool_call_parser),
        ("reasoning-parser", engine.reasoning_parser),
        ("chat-template", None if engine.chat_template is None else str(engine.chat_template)),
    ):
        if text is not None:
            argv += [f"--{flag}", text]
    return argv


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """``argv`` through vLLM's own ``vllm serve`` parser and its checks."""
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
    args: argparse.Namespace = parser.parse_args(argv)
    validate_parsed_serve_args(args)
    check_parser_names(args)
    return args


def check_parser_names(args: argparse.Namespace) -> None:
    """vLLM's own check that the tool and reasoning parsers are registered (``vllm serve``
    runs it before the engine starts), as a :class:`ConfigError` naming the worker's flag."""
    from vllm.entrypoints.openai import api_server

    check = getattr(api_server, "validate_api_server_args", None)
    if check is None:
        return
    try:
        check(args)
    except AttributeError:  # flags this check does not read: vLLM's app still refuses the name
        log.warning("vLLM's parser name check did not run on these serve flags", exc_info=True)
    except KeyError as exc:
        message = str(exc.args[0]) if exc.args else str(exc)
        flag = "--vllm-reasoning-parser" if "reasoning" in message else "--vllm-tool-call-parser"
        raise ConfigError(flag, message) from exc


def start_engine(args: argparse.Namespace) -> Any:
    """vLLM's ``AsyncLLM`` for ``args`` (blocking: it starts the engine core and loads)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    vllm_forkserver.install()  # the engine core from the fork server, where it runs
    engine_args = AsyncEngineArgs.from_cli_args(args)
    usage = UsageContext.OPENAI_API_SERVER
    vllm_config = engine_args.create_engine_config(usage_context=usage)
    return AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=usage,
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )


async def build_openai_app(
    engine: Any, args: argparse.Namespace
) -> tuple[Any, contextlib.AbstractAsyncContextManager[Any]]:
    """vLLM's OpenAI app over ``engine``, its state initialised and its lifespan entered
    (``vllm serve``'s own steps: the lifespan freezes the startup heap out of the garbage
    collector's way); the app and the lifespan to exit at shutdown."""
    from vllm.entrypoints.openai.api_server import build_app, init_app_state

    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    lifespan: contextlib.AbstractAsyncContextManager[Any] = app.router.lifespan_context(app)
    await lifespan.__aenter__()
    return app, lifespan


def request_fields() -> dict[str, frozenset[str]]:
    """Per route the stage checks, the field names and aliases of vLLM's pydantic request
    model: what its server honours (it logs any other field and serves without it)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    models = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
    out: dict[str, frozenset[str]] = {}
    for route, model in models.items():
        names: set[str] = set()
        for name, field in model.model_fields.items():
            names.add(name)
            if alias := getattr(field, "alias", None):
                names.add(alias)
        out[route] = frozenset(names)
    return out


class LoopBridge:
    """Runs coroutines on the worker's event loop from another thread, blocking for the result."""

    def __init__(self) -> None:
        try:
            self.loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self.loop = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        if self.loop is None:
            coro.close()
            raise RuntimeError("the vLLM runner was built outside the worker's event loop")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
