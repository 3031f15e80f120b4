"""The worker's grpc.aio server: services, health, reflection, auth, TLS, graceful stop.

With ``--health-port`` a second, plaintext server answers grpc.health.v1 only (the same
statuses), so the kubelet's gRPC probes, which cannot speak TLS, reach a TLS-only worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from omnistage.worker.v1 import (
    demand_service_pb2,
    demand_service_pb2_grpc,
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
)
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners import create_runner
from omnistage_worker.runners.base import ModelRunner
from omnistage_worker.runners.embeds import MAX_MESSAGE_BYTES
from omnistage_worker.serving.auth import BearerTokenInterceptor
from omnistage_worker.serving.demand_service import DemandServicer
from omnistage_worker.serving.health import HealthReporter
from omnistage_worker.serving.inference_service import InferenceServicer
from omnistage_worker.serving.metrics_serve import GrpcRequestCounter, MetricsServer
from omnistage_worker.serving.sleep_service import SleepServicer
from omnistage_worker.serving.token_review import TokenReviewer, TokenReviewInterceptor
from omnistage_worker.state import Worker

if TYPE_CHECKING:
    from omnistage_worker.serving.openai_http import HttpServer

log = logging.getLogger(__name__)


class WorkerServer:
    """One worker: the gRPC server starts at once, the model loads behind it.

    With ``--http-port`` the OpenAI-compatible HTTP API (:mod:`.openai_http`) runs beside it.
    While loading, GetStatus reports LOADING, the inference service is NOT_SERVING and
    Sleep/WakeUp answer UNAVAILABLE.
    """

    def __init__(self, config: WorkerConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.worker = Worker(config, runner if runner is not None else create_runner(config))
        self.health = HealthReporter()
        self.worker.add_listener(self.health.update)
        # The counter first: it sees every answer, the bearer check's refusals included.
        interceptors: list[grpc.aio.ServerInterceptor] = [GrpcRequestCounter(self.worker.metrics)]
        if config.token:
            interceptors.append(BearerTokenInterceptor(config.token))
        self.reviewer = (
            TokenReviewer(config.token_review) if config.token_review is not None else None
        )
        if self.reviewer is not None:
            interceptors.append(TokenReviewInterceptor(self.reviewer))
        # Room for a pipeline's prompt embeds (checked against their own limit on arrival).
        self.server = grpc.aio.server(
            interceptors=interceptors,
            options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
        )
        sleep_service_pb2_grpc.add_SleepServiceServicer_to_server(
            SleepServicer(self.worker), self.server
        )
        inference_service_pb2_grpc.add_InferenceServiceServicer_to_server(
            InferenceServicer(self.worker), self.server
        )
        demand_service_pb2_grpc.add_DemandServiceServicer_to_server(
            DemandServicer(self.worker), self.server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.server)
        reflection.enable_server_reflection(
            (
                sleep_service_pb2.DESCRIPTOR.services_by_name["SleepService"].full_name,
                inference_service_pb2.DESCRIPTOR.services_by_name["InferenceService"].full_name,
                demand_service_pb2.DESCRIPTOR.services_by_name["DemandService"].full_name,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            ),
            self.server,
        )
        self.health_server = grpc.aio.server() if config.health_port is not None else None
        if self.health_server is not None:
            health_pb2_grpc.add_HealthServicer_to_server(self.health.servicer, self.health_server)
        self._load_task: asyncio.Task[None] | None = None
        self.port = 0
        self.health_port = 0
        self.http: HttpServer | None = None
        self.http_port = 0
        self.metrics: MetricsServer | None = None
        self.metrics_port = 0
        self._stopped = False

    async def start(self) -> int:
        """Bind, start serving, start loading the model; the bound port."""
        config = self.config
        address = f"{config.host}:{config.port}"
        if config.tls_cert is not None and config.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
            )
            self.port = self.server.add_secure_port(address, credentials)
            log.info("TLS enabled (certificate %s)", config.tls_cert)
        else:
            self.port = self.server.add_insecure_port(address)
        if self.health_server is not None and config.health_port is not None:
            self.health_port = self.health_server.add_insecure_port(
                f"{config.host}:{config.health_port}"
            )
        await self.health.update(self.worker.current)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()
            log.info("plaintext gRPC health on %s:%d", config.host, self.health_port)
        if config.token:
            log.info(
                "SleepService and DemandService require a bearer token; "
                "InferenceService and health are open"
            )
        if config.token_review is not None:
            log.info(
                "SleepService and DemandService require a token of %s for audience %r "
                "(TokenReview)",
                config.token_review.operator_identity,
                config.token_review.audience,
            )
        if config.http_port is not None:
            from omnistage_worker.serving.openai_http import HttpServer

            app = None
            engine_app = getattr(self.worker.runner, "engine_app", None)
            if callable(engine_app):  # an engine serving its own API (vLLM), behind the gate
                from omnistage_worker.serving.vllm_front import VllmFront

                fields = getattr(self.worker.runner, "request_fields", dict)
                app = VllmFront(self.worker, engine_app, fields)
            self.http = HttpServer(
                self.worker, config.host, config.http_port, config.shutdown_grace_s, app=app
            )
            if config.http_token:
                log.info("the OpenAI HTTP API requires a bearer token (/health is open)")
            self.http_port = await self.http.start()
            log.info("OpenAI-compatible HTTP on %s:%d", config.host, self.http_port)
        if config.metrics_port is not None:
            self.metrics = MetricsServer(
                self.worker.metrics.registry, config.host, config.metrics_port
            )
            self.metrics_port = await self.metrics.start()
            log.info("Prometheus metrics on %s:%d", config.host, self.metrics_port)
        self._load_task = asyncio.ensure_future(self.worker.load())
        return self.port

    async def wait_loaded(self) -> None:
        """Wait until loading has ended (ACTIVE, ASLEEP or FAILED)."""
        await self.worker.loaded.wait()

    async def stop(self, grace: float) -> None:
        """Answer held and queued requests (503 / UNAVAILABLE, retry elsewhere), health
        NOT_SERVING, then let running calls finish within ``grace`` seconds (once: a second
        call returns at once)."""
        if self._stopped:
            return
        self._stopped = True
        self.worker.terminate()
        await self.health.shutdown()
        log.info("health NOT_SERVING; waiting up to %.1fs for in-flight calls", grace)
        if self.http is not None:
            await self.http.stop()
        await self.server.stop(grace)
        if self.health_server is not None:
            await self.health_server.stop(0)
        if self.metrics is not None:
            await self.metrics.stop()
        if self.reviewer is not None:
            await self.reviewer.aclose()
        if self._load_task is not None and not self._load_task.done():
            self._load_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._load_task
        await self.worker.aclose()
