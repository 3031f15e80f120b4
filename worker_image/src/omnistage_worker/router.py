"""One OpenAI URL for a colocation group: requests go to the stage named by their ``model``.

``omnistage-router --namespace NS --stage tiny-llama --stage tiny-diffusion`` sends a request
whose ``model`` is ``tiny-llama`` to ``http://tiny-llama-worker.NS.svc:8000`` (the stage's
Service, ``worker.httpPort``); ``--route NAME=URL`` names a backend explicitly. Bodies, status,
``Retry-After`` and ``x-omnistage-held-ms`` pass through unchanged, SSE streams as it arrives, so
a request to a sleeping OnDemand stage is held by its worker exactly as when sent there
directly. ``GET /v1/models`` lists the group's stages; an unknown ``model`` is a 404 in the
OpenAI error shape; a backend that cannot be reached is a 502.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from omnistage_worker.openai_api import error_body

log = logging.getLogger(__name__)

PASSED_HEADERS = ("content-type", "retry-after", "x-omnistage-held-ms", "cache-control")


def stage_routes(namespace: str, stages: Sequence[str], port: int) -> dict[str, str]:
    """model name -> the stage's Service URL."""
    return {s: f"http://{s}-worker.{namespace}.svc:{port}" for s in stages}


class Router:
    """The routes over a fixed model -> backend table."""

    def __init__(self, routes: Mapping[str, str], timeout: float = 600.0) -> None:
        self.routes = dict(routes)
        self.created = int(time.time())
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

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        yield
        await self.client.aclose()

    async def models(self, request: Request) -> Response:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "omnistage"}
            for name in sorted(self.routes)
        ]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": sorted(self.routes)})

    async def forward(self, request: Request) -> Response:
        raw = await request.body()
        try:
            body: Any = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            return JSONResponse(
                error_body("the request body is not JSON", "invalid_request_error"), 400
            )
        model = body.get("model") if isinstance(body, dict) else None
        target = self.routes.get(model) if isinstance(model, str) else None
        if target is None:
            known = ", ".join(sorted(self.routes))
            message = f"the model {model!r} does not exist here (models: {known})"
            return JSONResponse(
                error_body(message, "invalid_request_error", "model", "model_not_found"), 404
            )
        upstream = self.client.build_request(
            "POST",
            f"{target}{request.url.path}",
            content=raw,
            headers={"content-type": "application/json"},
        )
        try:
            reply = await self.client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            message = f"stage {model!r} at {target} cannot be reached: {exc}"
            return JSONResponse(error_body(message, "server_error", None, "bad_gateway"), 502)
        headers = {k: v for k, v in reply.headers.items() if k.lower() in PASSED_HEADERS}
        return StreamingResponse(
            _relay(reply),
            status_code=reply.status_code,
            headers=headers,
            background=BackgroundTask(reply.aclose),
        )


async def _relay(reply: httpx.Response) -> AsyncIterator[bytes]:
    async for chunk in reply.aiter_raw():
        yield chunk


def parse_routes(
    namespace: str, stages: Sequence[str], port: int, routes: Sequence[str]
) -> dict[str, str]:
    """The routing table from ``--stage`` and ``--route NAME=URL`` flags."""
    table = stage_routes(namespace, stages, port)
    for item in routes:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            raise ValueError(f"--route {item!r}: use NAME=http://host:port")
        table[name] = url.rstrip("/")
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
    args = p.parse_args(argv)
    try:
        table = parse_routes(args.namespace, args.stage, args.worker_port, args.route)
    except ValueError as exc:
        p.error(str(exc))
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    log.info("routes: %s", table)
    uvicorn.run(Router(table).app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())
