"""Run one Kubernetes probe (grpc, tcpSocket, httpGet, exec) against a local pod process."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc

Obj = dict[str, Any]


def resolve_port(port: int | str, container: Obj) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(
        f"probe names port {port!r}, which container {container['name']!r} does not declare"
    )


async def run_probe(
    probe: Obj, container: Obj, pod_ip: str, env: dict[str, str], cwd: Path
) -> tuple[bool, str]:
    """Run ``probe`` once: (success, message)."""
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "grpc" in probe:
            return await _grpc(probe["grpc"], pod_ip, timeout)
        if "tcpSocket" in probe:
            port = resolve_port(probe["tcpSocket"]["port"], container)
            host = probe["tcpSocket"].get("host") or pod_ip
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return True, ""
        if "httpGet" in probe:
            get = probe["httpGet"]
            port = resolve_port(get["port"], container)
            scheme = str(get.get("scheme", "HTTP")).lower()
            url = f"{scheme}://{get.get('host') or pod_ip}:{port}{get.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or []}
            async with httpx.AsyncClient(verify=False, timeout=timeout) as client:
                r = await client.get(url, headers=headers)
            return 200 <= r.status_code < 400, f"HTTP probe failed with statuscode: {r.status_code}"
        if "exec" in probe:
            cmd = probe["exec"]["command"]
            proc = await asyncio.create_subprocess_exec(
                *cmd,
                env=env,
                cwd=cwd,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            try:
                out, _ = await asyncio.wait_for(proc.communicate(), timeout)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                return False, f"command timed out after {timeout:.0f}s"
            return proc.returncode == 0, out.decode(errors="replace")[-500:]
    except (OSError, TimeoutError, ValueError, httpx.HTTPError) as exc:
        return False, f"{type(exc).__name__}: {exc}"
    return False, "probe has no handler (grpc, tcpSocket, httpGet or exec)"


# One channel per probed address, kept: a new connection per probe costs more CPU than the
# probe itself, which hundreds of pods on one localnode cannot afford. A pod's address is
# reused by a later pod only after it is gone, and the channel then reconnects to that one.
_CHANNELS: dict[str, grpc.aio.Channel] = {}


def _channel(target: str) -> grpc.aio.Channel:
    channel = _CHANNELS.get(target)
    if channel is None:
        channel = _CHANNELS[target] = grpc.aio.insecure_channel(
            target, options=[("grpc.max_reconnect_backoff_ms", 1000)]
        )
    return channel


async def _grpc(spec: Obj, pod_ip: str, limit_s: float) -> tuple[bool, str]:
    target = f"{pod_ip}:{int(spec['port'])}"
    stub = health_pb2_grpc.HealthStub(_channel(target))
    try:
        reply = await stub.Check(
            health_pb2.HealthCheckRequest(service=spec.get("service") or ""), timeout=limit_s
        )
    except grpc.aio.AioRpcError as exc:
        return (
            False,
            f"grpc health check to {target} failed: {exc.code().name}: {exc.details()}",
        )
    ok = reply.status == health_pb2.HealthCheckResponse.SERVING
    return (
        ok,
        ""
        if ok
        else "service unhealthy (responded with "
        f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)})",
    )
