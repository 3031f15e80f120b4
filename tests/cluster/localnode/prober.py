"""Startup, readiness and liveness probing of one running container, as the kubelet does it.

The startup probe gates the others; readiness flips ``ready`` after ``successThreshold``
successes and back after ``failureThreshold`` failures; liveness (and a failed startup probe)
kills the container through ``hooks.kill`` so the restart policy applies.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.localnode.podstatus import ContainerStatus
from tests.cluster.localnode.probes import run_probe

log = logging.getLogger("localnode.probe")
Obj = dict[str, Any]


@dataclass(frozen=True)
class ProbeTarget:
    """The container probed: its spec, the pod IP and the env/cwd exec probes run with."""

    spec: Obj
    pod_ip: str
    env: dict[str, str]
    cwd: Path

    async def probe(self, probe: Obj) -> tuple[bool, str]:
        """Run ``probe`` once against this container."""
        return await run_probe(probe, self.spec, self.pod_ip, self.env, self.cwd)


@dataclass(frozen=True)
class ProbeHooks:
    """What probing may do to the pod: mark status dirty, kill the container, emit events."""

    mark: Callable[[], None]
    kill: Callable[[str, float | None], Awaitable[None]]
    warn: Callable[[str, str], None]


async def probe_container(target: ProbeTarget, st: ContainerStatus, hooks: ProbeHooks) -> None:
    """Probe until cancelled (the caller cancels when the process exits)."""
    spec = target.spec
    startup = spec.get("startupProbe")
    if startup:
        if not await _until_success(startup, target):
            await hooks.kill("startup probe failed", None)
            return
        st.started = True
        if "readinessProbe" not in spec:
            st.ready = True
        hooks.mark()
    tasks = []
    if "readinessProbe" in spec:
        tasks.append(asyncio.create_task(_readiness(spec["readinessProbe"], target, st, hooks)))
    if "livenessProbe" in spec:
        tasks.append(asyncio.create_task(_liveness(spec["livenessProbe"], target, hooks)))
    try:
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()


def _timing(probe: Obj) -> tuple[float, float]:
    return float(probe.get("initialDelaySeconds", 0)), float(probe.get("periodSeconds", 10))


async def _until_success(probe: Obj, target: ProbeTarget) -> bool:
    delay, period = _timing(probe)
    await asyncio.sleep(delay)
    threshold = int(probe.get("failureThreshold", 3))
    failures = 0
    while True:
        ok, _ = await target.probe(probe)
        if ok:
            return True
        failures += 1
        if failures >= threshold:
            return False
        await asyncio.sleep(period)


async def _readiness(
    probe: Obj, target: ProbeTarget, st: ContainerStatus, hooks: ProbeHooks
) -> None:
    delay, period = _timing(probe)
    await asyncio.sleep(delay)
    succ_needed = int(probe.get("successThreshold", 1))
    fail_needed = int(probe.get("failureThreshold", 3))
    succ = fail = 0
    while True:
        ok, msg = await target.probe(probe)
        if ok:
            succ, fail = succ + 1, 0
            if not st.ready and succ >= succ_needed:
                st.ready = True
                hooks.mark()
        else:
            succ, fail = 0, fail + 1
            if fail == 1:
                hooks.warn("Unhealthy", f"Readiness probe failed: {msg}")
            if st.ready and fail >= fail_needed:
                log.info("container %s readiness failed: %s", target.spec["name"], msg)
                st.ready = False
                hooks.mark()
        await asyncio.sleep(period)


async def _liveness(probe: Obj, target: ProbeTarget, hooks: ProbeHooks) -> None:
    delay, period = _timing(probe)
    await asyncio.sleep(delay)
    fail_needed = int(probe.get("failureThreshold", 3))
    fail = 0
    while True:
        ok, msg = await target.probe(probe)
        fail = 0 if ok else fail + 1
        if fail >= fail_needed:
            hooks.warn("Unhealthy", f"Liveness probe failed: {msg}")
            grace = probe.get("terminationGracePeriodSeconds")
            await hooks.kill(
                f"failed liveness probe: {msg}", None if grace is None else float(grace)
            )
            return
        await asyncio.sleep(period)
