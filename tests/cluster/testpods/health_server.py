"""A gRPC server with only grpc.health.v1, bound to --host:--port; exits on SIGTERM.

``python -m tests.cluster.testpods.health_server --host 127.10.0.2 --port 50051``
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=50051)
    args = parser.parse_args(argv)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    server.add_insecure_port(f"{args.host}:{args.port}")
    server.start()
    print(f"health server pid {os.getpid()} serving on {args.host}:{args.port}", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    print("SIGTERM: stopping", flush=True)
    server.stop(1).wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
