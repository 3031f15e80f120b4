"""``omnistage-operator``: the kopf operator with a liveness endpoint and Prometheus metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Sequence

import kopf
from prometheus_client import start_http_server

from omnistage_operator.settings import SettingsError, parse_settings

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Parse flags, start the metrics server and run kopf until stopped."""
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stdout,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        settings = parse_settings(argv)
        settings.worker_token()  # fail early on an empty or unreadable token file
    except (SettingsError, OSError) as exc:
        print(f"omnistage-operator: {exc}", file=sys.stderr)
        return 2
    os.environ["OMNISTAGE_RESYNC_INTERVAL"] = str(settings.resync_interval_s)
    from omnistage_operator import handlers  # registers the kopf handlers

    handlers.configure(settings)
    start_http_server(settings.metrics_port)
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
    liveness = f"http://0.0.0.0:{settings.liveness_port}/healthz"
    asyncio.run(
        kopf.operator(
            clusterwide=not settings.namespaces,
            namespaces=list(settings.namespaces),
            standalone=settings.peering is None,
            peering_name=settings.peering,
            liveness_endpoint=liveness,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
