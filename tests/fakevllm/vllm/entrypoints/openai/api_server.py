"""STAND-IN of ``vllm.entrypoints.openai.api_server``'s ``build_app`` and ``init_app_state``.

The routes the stand-in serves, in vLLM 0.24's response shapes: ``/v1/completions`` and
``/v1/chat/completions`` (``n``, ``stop``, ``seed``, ``temperature``, ``max_tokens``,
``ignore_eos``, streaming with ``stream_options.include_usage``; every answer carries
``usage``), ``/v1/models``, ``/health``, ``/tokenize``, and vLLM's development routes
(``/sleep``, ``/wake_up``, ``/is_sleeping``) which real vLLM registers with
``VLLM_SERVER_DEV_MODE``. A field the route's request model does not define (``best_of``,
gone from vLLM's models) is logged as ignored and the request served without it, as vLLM does;
other fields of the models outside that set are ignored silently, except ``logprobs``,
``tools`` and the like, refused (400) because the stand-in cannot compute them. Errors
use vLLM's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.datastructures import State
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from vllm import RequestOutputKind, SamplingParams
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest

UNSUPPORTED = ("logprobs", "top_logprobs", "tools", "response_format", "echo")
log = logging.getLogger(__name__)


def _log_ignored(body: Any, chat: bool) -> None:
    """As vLLM's request models (extra fields allowed): a field the model does not define is
    logged, with vLLM's message, and the request served without it."""
    if not isinstance(body, dict):
        return
    model = ChatCompletionRequest if chat else CompletionRequest
    ignored = body.keys() - model.model_fields.keys()
    if ignored:
        log.warning("The following fields were present in the request but ignored: %s", ignored)


class BadRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _error(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    kind = "BadRequestError" if status == 400 else "InternalServerError"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


def _usage(prompt: int, completion: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt, "total_tokens": prompt + completion,
            "completion_tokens": completion, "prompt_tokens_details": None}  # fmt: skip


def _sse(body: dict[str, Any] | str) -> bytes:
    data = body if isinstance(body, str) else json.dumps(body)
    return f"data: {data}\n\n".encode()


class Routes:
    def __init__(self, state: State) -> None:
        self.state = state

    @property
    def engine(self) -> Any:
        return self.state.engine_client

    @property
    def served(self) -> str:
        return str(self.state.served_model_names[0])

    def _params(self, body: dict[str, Any], max_len: int, prompt_len: int) -> SamplingParams:
        for name in UNSUPPORTED:
            if body.get(name) not in (None, False):
                raise BadRequest(f"the stand-in engine does not implement {name}", name)
        model = body.get("model")
        if model is not None and model not in self.state.served_model_names:
            raise BadRequest(f"The model `{model}` does not exist.", "model")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        room = max_len - prompt_len
        if max_tokens is not None and max_tokens > room:
            raise BadRequest(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This "
                f"model's maximum context length is {max_len} tokens and your request has "
                f"{prompt_len} input tokens ({max_tokens} > {max_len} - {prompt_len}).",
                "max_tokens",
            )
        try:
            return SamplingParams(
                n=int(body.get("n") or 1),
                temperature=float(body.get("temperature", 1.0) if body.get("temperature")
                                  is not None else 1.0),
                top_p=float(body.get("top_p") or 1.0),
                seed=body.get("seed"),
                stop=body.get("stop"),
                ignore_eos=bool(body.get("ignore_eos", False)),
                max_tokens=max_tokens if max_tokens is not None else room,
                output_kind=RequestOutputKind.CUMULATIVE,
            )  # fmt: skip
        except (ValueError, TypeError) as exc:
            raise BadRequest(str(exc)) from exc

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def _serve(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.json()
            _log_ignored(body, chat)
            prompt: Any
            if chat:
                prompt = self._render(body.get("messages"))
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                engine_prompt: Any = {"prompt_token_ids": prompt}
                prompt_len = len(prompt)
            elif isinstance(prompt, str):
                engine_prompt, prompt_len = prompt, len(self.engine.encode(prompt))
            else:
                raise BadRequest("prompt must be a string or a list of token ids", "prompt")
            max_len = int(self.engine.model_config.max_model_len)
            params = self._params(body, max_len, prompt_len)
        except BadRequest as exc:
            return _error(str(exc), 400, exc.param)
        except (ValueError, json.JSONDecodeError) as exc:
            return _error(str(exc), 400)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        results = self.engine.generate(engine_prompt, params, request_id)
        if body.get("stream"):
            options = body.get("stream_options") or {}
            return StreamingResponse(
                self._stream(results, request_id, chat, bool(options.get("include_usage"))),
                media_type="text/event-stream",
            )
        final = None
        try:
            async for out in results:
                final = out
        except ValueError as exc:
            return _error(str(exc), 400)
        assert final is not None
        completion = sum(len(o.token_ids) for o in final.outputs)
        choices = [self._choice(o, chat) for o in final.outputs]
        return JSONResponse({
            "id": request_id, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": self.served, "choices": choices,
            "service_tier": None, "system_fingerprint": None,
            "usage": _usage(len(final.prompt_token_ids), completion),
            "prompt_logprobs": None, "kv_transfer_params": None,
        })  # fmt: skip

    def _choice(self, o: Any, chat: bool) -> dict[str, Any]:
        if chat:
            message = {"role": "assistant", "content": o.text, "refusal": None,
                       "annotations": None, "audio": None, "function_call": None,
                       "tool_calls": [], "reasoning": None}  # fmt: skip
            return {"index": o.index, "message": message, "logprobs": None,
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                    "token_ids": None}  # fmt: skip
        return {"index": o.index, "text": o.text, "logprobs": None,
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
                "token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None}  # fmt: skip

    async def _stream(
        self, results: Any, request_id: str, chat: bool, include_usage: bool
    ) -> AsyncIterator[bytes]:
        kind = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        sent: dict[int, int] = {}  # per choice: characters already sent
        prompt_len, completion = 0, 0
        first = True
        try:
            async for out in results:
                prompt_len = len(out.prompt_token_ids)
                completion = sum(len(o.token_ids) for o in out.outputs)
                for o in out.outputs:
                    done = sent.get(o.index, 0)
                    delta = o.text[done:]
                    if not delta and o.finish_reason is None and not first:
                        continue
                    sent[o.index] = len(o.text)
                    if chat:
                        content: dict[str, Any] = {"content": delta}
                        if first:
                            content["role"] = "assistant"
                        choice = {"index": o.index, "delta": content, "logprobs": None,
                                  "finish_reason": o.finish_reason,
                                  "stop_reason": o.stop_reason}  # fmt: skip
                    else:
                        choice = {"index": o.index, "text": delta, "logprobs": None,
                                  "finish_reason": o.finish_reason,
                                  "stop_reason": o.stop_reason}  # fmt: skip
                    yield _sse({"id": request_id, "object": kind, "created": created,
                                "model": self.served, "choices": [choice]})  # fmt: skip
                first = False
        except ValueError as exc:
            yield _sse({"error": {"message": str(exc), "type": "BadRequestError",
                                  "param": None, "code": 400}})  # fmt: skip
        if include_usage:
            yield _sse({"id": request_id, "object": kind, "created": created,
                        "model": self.served, "choices": [],
                        "usage": _usage(prompt_len, completion)})  # fmt: skip
        yield _sse("[DONE]")

    def _render(self, messages: Any) -> str:
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        template = self.state.chat_template
        if template is None:
            raise BadRequest(
                "As of transformers v4.44, default chat template is no longer allowed, so you "
                "must provide a chat template if the tokenizer does not define one."
            )
        import jinja2

        rendered: str = jinja2.Template(template).render(
            messages=messages, add_generation_prompt=True
        )
        return rendered

    async def models(self, request: Request) -> Response:
        data = [{"id": name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                 "root": self.state.args.model, "parent": None,
                 "max_model_len": self.engine.model_config.max_model_len}
                for name in self.state.served_model_names]  # fmt: skip
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        try:
            await self.engine.check_health()
        except Exception:
            return Response(status_code=503)
        return Response(status_code=200)

    async def tokenize(self, request: Request) -> Response:
        body = await request.json()
        ids = self.engine.encode(str(body.get("prompt", "")))
        max_len = self.engine.model_config.max_model_len
        return JSONResponse({"count": len(ids), "max_model_len": max_len, "tokens": ids,
                             "token_strs": None})  # fmt: skip

    async def sleep(self, request: Request) -> Response:
        await self.engine.sleep(int(request.query_params.get("level", "1")))
        return Response(status_code=200)

    async def wake_up(self, request: Request) -> Response:
        tags = request.query_params.getlist("tags") or None
        await self.engine.wake_up(tags)
        return Response(status_code=200)

    async def is_sleeping(self, request: Request) -> Response:
        return JSONResponse({"is_sleeping": await self.engine.is_sleeping()})


@contextlib.asynccontextmanager
async def lifespan(app: Starlette) -> AsyncIterator[None]:
    """As vLLM's: the startup heap is frozen out of the garbage collector's way."""
    gc.collect(0)
    gc.collect(1)
    gc.collect(2)
    gc.freeze()
    yield


def build_app(
    args: argparse.Namespace,
    supported_tasks: tuple[str, ...] | None = None,
    model_config: Any = None,
) -> Starlette:
    state = State()
    routes = Routes(state)
    app = Starlette(
        routes=[
            Route("/v1/completions", routes.completions, methods=["POST"]),
            Route("/v1/chat/completions", routes.chat, methods=["POST"]),
            Route("/v1/models", routes.models, methods=["GET"]),
            Route("/health", routes.health, methods=["GET"]),
            Route("/tokenize", routes.tokenize, methods=["POST"]),
            Route("/sleep", routes.sleep, methods=["POST"]),
            Route("/wake_up", routes.wake_up, methods=["POST"]),
            Route("/is_sleeping", routes.is_sleeping, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state = state
    app.state.args = args
    return app


async def init_app_state(
    engine_client: Any,
    state: State,
    args: argparse.Namespace,
    supported_tasks: tuple[str, ...] | None = None,
) -> None:
    state.engine_client = engine_client
    state.vllm_config = engine_client.vllm_config
    state.args = args
    state.served_model_names = args.served_model_name or [args.model]
    # What vLLM's OpenAIServingChat keeps: tool calls only with auto tool choice and a parser.
    state.enable_auto_tools = args.enable_auto_tool_choice
    state.tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
    state.reasoning_parser = engine_client.vllm_config.structured_outputs_config.reasoning_parser
    state.chat_template = _chat_template(args)


def _chat_template(args: argparse.Namespace) -> str | None:
    """``--chat-template`` (a file is read, as vLLM's ``load_chat_template``), else the
    tokenizer's."""
    from pathlib import Path

    template: str | None = args.chat_template
    if template is not None and Path(template).is_file():
        return Path(template).read_text()
    if template is None:
        config = Path(args.model) / "tokenizer_config.json"
        if config.is_file():
            found: str | None = json.loads(config.read_text()).get("chat_template")
            return found
    return template


TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def validate_api_server_args(args: argparse.Namespace) -> None:
    """As vLLM's (``vllm serve`` runs it before the engine starts): registered parser names."""
    if args.enable_auto_tool_choice and args.tool_call_parser not in TOOL_PARSERS:
        raise KeyError(
            f"invalid tool call parser: {args.tool_call_parser} "
            f"(chose from {{ {','.join(TOOL_PARSERS)} }})"
        )
    if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:
        raise KeyError(
            f"invalid reasoning parser: {args.reasoning_parser} "
            f"(chose from {{ {','.join(REASONING_PARSERS)} }})"
        )


def main() -> None:
    """``python -m vllm.entrypoints.openai.api_server ...``: the stand-in's bare server."""
    import asyncio

    import uvicorn
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    args = make_arg_parser(FlexibleArgumentParser()).parse_args()
    validate_parsed_serve_args(args)
    validate_api_server_args(args)

    async def serve() -> None:
        engine = AsyncLLM.from_vllm_config(
            AsyncEngineArgs.from_cli_args(args).create_engine_config()
        )
        tasks = await engine.get_supported_tasks()
        app = build_app(args, tasks, engine.model_config)
        await init_app_state(engine, app.state, args, tasks)
        config = uvicorn.Config(app, host=args.host or "0.0.0.0", port=args.port,
                                log_level="warning", access_log=False)  # fmt: skip
        try:
            await uvicorn.Server(config).serve()
        finally:
            engine.shutdown()

    asyncio.run(serve())


if __name__ == "__main__":
    main()
