"""One OpenAI URL for a colocation group: requests go to the stage named by their ``model``.

``omnistage-router --namespace NS --stage tiny-llama --stage tiny-diffusion`` sends a request
whose ``model`` is ``tiny-llama`` to ``http://tiny-llama-worker.NS.svc:8000`` (the stage's
Service, ``worker.httpPort``); ``--route NAME=URL`` names a backend explicitly. Bodies, status,
``Retry-After`` and ``x-omnistage-held-ms`` pass through unchanged, SSE streams as it arrives, so
a request to a sleeping OnDemand stage is held by its worker exactly as when sent there
directly. ``GET /v1/models`` lists the group's stages; an unknown ``model`` is a 404 in the
OpenAI error shape; a backend that cannot be reached is a 502.

Nothing lost when a worker goes: a request that never reached a model (the connection was
refused, or the worker answered 503 with ``x-omnistage-unserved`` while shutting down) is sent
again, to the stage's next backend (``--route NAME=URL`` repeated) or, behind one Service URL,
to the same URL after a short pause (the Service then sends it to the next ready pod), for up
to ``--retry-within`` seconds (15). A request that reached a model is never sent twice.
``--token-file`` makes the router require a bearer token (``/health`` stays open); the client's
``Authorization`` goes on to the stage.

``--pipeline NAME=STAGE:embeds,STAGE`` serves a pipeline under ``NAME``: each request runs
through the stages over their gRPC port (:mod:`.pipeline_serve`; ``--grpc-route
STAGE=HOST:PORT`` names a stage's address, else ``STAGE-worker.NS.svc:--worker-grpc-port``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omnistage_worker.config import ConfigError, parse_byte_flag, read_token
from omnistage_worker.control.queued import UNSERVED_HEADER
from omnistage_worker.limits import DEFAULT_REQUEST_BODY_BYTES
from omnistage_worker.serving.http_auth import BearerAuth
from omnistage_worker.serving.openai_api import error_body
from omnistage_worker.serving.pipeline_def import parse_pipeline
from omnistage_worker.serving.pipeline_serve import PipelineServer, grpc_targets

log = logging.getLogger(__name__)

PASSED_HEADERS = ("content-type", "retry-after", "x-omnistage-held-ms", "cache-control")
# How long a request that never reached a model is sent again (a replaced pod needs a moment
# behind its Service), and the pauses before a backend is tried again (doubling, at most 2 s).
RETRY_WITHIN_S = 15.0
FIRST_PAUSE_S = 0.25
MAX_PAUSE_S = 2.0

Routes = Mapping[str, Sequence[str]]


def stage_routes(namespace: str, stages: Sequence[str], port: int) -> dict[str, list[str]]:
    """model name -> the stage's Service URL."""
    return {s: [f"http://{s}-worker.{namespace}.svc:{port}"] for s in stages}


class Router:
    """The routes over a fixed model -> backends table."""

    def __init__(
        self,
        routes: Routes,
        timeout: float = 600.0,
        token: str | None = None,
        max_request_bytes: int = DEFAULT_REQUEST_BODY_BYTES,
        retry_within: float = RETRY_WITHIN_S,
        *,
        pipelines: Mapping[str, PipelineServer] | None = None,
    ) -> None:
        self.routes = {name: list(urls) for name, urls in routes.items()}
        self.pipelines = dict(pipelines or {})
        self.created = int(time.time())
        self.max_request_bytes = max_request_bytes
        self.retry_within = retry_within
        self.retried = 0  # requests sent again because they never reached a model
        self.client = httpx.AsyncClient(timeout=timeout)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.forward, methods=["POST"]),
                Route("/v1/chat/completions", self.forward, methods=["POST"]),
                Route("/v1/images/generations", self.forward, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ],
            lifespan=self._lifespan,
        )
        self.asgi: Any = BearerAuth(self.app, token) if token else self.app

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.client.aclose()
        for pipeline in self.pipelines.values():
            await pipeline.close()

    async def models(self, request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "omnistage"}
            for name in sorted({*self.routes, *self.pipelines})
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": sorted({*self.routes, *self.pipelines})})

    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        if len(raw) > self.max_request_bytes:
            message = f"the request body is larger than the limit of {self.max_request_bytes} bytes"
            return JSONResponse(
                error_body(message, "invalid_request_error", None, "request_too_large"), 413
            )
        try:
            body: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse(
                error_body("the request body is not JSON", "invalid_request_error"), 400
            )
        model = body.get("model") if isinstance(body, dict) else None
        if isinstance(model, str) and model in self.pipelines:
            return await self.pipelines[model].serve(request.url.path, body)
        targets = self.routes.get(model) if isinstance(model, str) else None
        if not targets:
            known = ", ".join(sorted({*self.routes, *self.pipelines}))
            message = f"the model {model!r} does not exist here (models: {known})"
            return JSONResponse(
                error_body(message, "invalid_request_error", "model", "model_not_found"), 404
            )
        headers = {"content-type": "application/json"}
        if "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        reply = await self._send(str(model), targets, request.url.path, raw, headers)
        if isinstance(reply, Response):
            return reply
        passed = {k: v for k, v in reply.headers.items() if k.lower() in PASSED_HEADERS}
        return StreamingResponse(
            _relay(reply),
            status_code=reply.status_code,
            headers=passed,
            background=BackgroundTask(reply.aclose),
        )

    async def _send(
        self, model: str, targets: Sequence[str], path: str, raw: bytes, headers: dict[str, str]
    ) -> httpx.Response | Response:
        """The first reply from a backend that reached a model (or the last refusal).

        Sent again only when it never reached one: the connection was refused, or the worker
        answered that it is shutting down (``x-omnistage-unserved``).
        """
        deadline = time.monotonic() + self.retry_within
        attempt = 0
        while True:
            target = targets[attempt % len(targets)]
            if attempt and attempt % len(targets) == 0:
                rounds = attempt // len(targets)
                await asyncio.sleep(min(MAX_PAUSE_S, FIRST_PAUSE_S * 2 ** (rounds - 1)))
            last = time.monotonic() >= deadline
            upstream = self.client.build_request(
                "POST", f"{target}{path}", content=raw, headers=headers
            )
            try:
                reply = await self.client.send(upstream, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                failure = f"stage {model!r} at {target} cannot be reached: {exc}"
            except httpx.HTTPError as exc:
                message = f"stage {model!r} at {target} failed: {exc!r}"
                return JSONResponse(error_body(message, "server_error", None, "bad_gateway"), 502)
            else:
                if UNSERVED_HEADER not in reply.headers or last:
                    return reply
                await reply.aclose()
                failure = f"stage {model!r} at {target} is shutting down"
            if last:
                return JSONResponse(error_body(failure, "server_error", None, "bad_gateway"), 502)
            attempt += 1
            self.retried += 1
            log.info("%s; sending the request again (attempt %d)", failure, attempt + 1)


async def _relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in reply.aiter_raw():
        yield chunk


def parse_routes(
    namespace: str, stages: Sequence[str], port: int, routes: Sequence[str]
) -> dict[str, list[str]]:
    """The routing table from ``--stage`` and ``--route NAME=URL`` flags (a name given
    several times has several backends, tried in order when one is going)."""
    table = stage_routes(namespace, stages, port)
    explicit: dict[str, list[str]] = {}
    for item in routes:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--route {item!r}: use NAME=http://host:port")
        explicit.setdefault(name, []).append(url.rstrip("/"))
    table.update(explicit)
    if not table:
        raise ValueError("give at least one --stage or --route")
    return table


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``omnistage-router``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--namespace", default="default", help="the stages' namespace")
    p.add_argument("--stage", action="append", default=[], help="a stage of the group")
    p.add_argument("--worker-port", type=int, default=8000, help="the stages' worker.httpPort")
    p.add_argument("--route", action="append", default=[], help="NAME=URL (explicit backend)")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--log-level", default="info")
    p.add_argument("--token-file", type=Path, help="bearer token clients must send (optional)")
    p.add_argument(
        "--max-request-bytes",
        default=str(DEFAULT_REQUEST_BODY_BYTES),
        help="largest request body (a quantity, default 1Mi): larger ones get 413",
    )
    p.add_argument(
        "--retry-within",
        type=float,
        default=RETRY_WITHIN_S,
        help="seconds a request that never reached a model is sent again (default 15)",
    )
    p.add_argument(
        "--pipeline",
        action="append",
        default=[],
        help="NAME=STAGE:embeds,STAGE (or STAGE:text): a pipeline served under NAME",
    )
    p.add_argument("--worker-grpc-port", type=int, default=50051, help="the stages' worker.port")
    p.add_argument(
        "--grpc-route", action="append", default=[], help="STAGE=HOST:PORT (a stage's gRPC)"
    )
    args = p.parse_args(argv)
    try:
        pipelines = [parse_pipeline(text) for text in args.pipeline]
        table: dict[str, list[str]] = {}
        if args.stage or args.route or not pipelines:
            table = parse_routes(args.namespace, args.stage, args.worker_port, args.route)
        grpc_routes = dict(item.partition("=")[::2] for item in args.grpc_route)
        targets = grpc_targets(pipelines, args.namespace, args.worker_grpc_port, grpc_routes)
        token = read_token(args.token_file) if args.token_file is not None else None
        limit = parse_byte_flag(args.max_request_bytes, "--max-request-bytes")
    except (ValueError, ConfigError) as exc:
        p.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    log.info("routes: %s%s", table, " (bearer token required)" if token else "")
    router = Router(
        table,
        token=token,
        max_request_bytes=limit,
        retry_within=args.retry_within,
        pipelines={p.name: PipelineServer(p, targets, args.retry_within) for p in pipelines},
    )
    uvicorn.run(router.asgi, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
