"""How a pod's container runs: a process (or a simulated worker) per run with its log and
probes, restarted per the restart policy with back-off, its termination message read after it
ends, and stopped with SIGTERM then SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.localnode import volumes
from tests.cluster.localnode.api import ApiError, Obj
from tests.cluster.localnode.container_setup import ConfigError, ContainerSetup
from tests.cluster.localnode.podstatus import ContainerStatus, now_rfc3339, termination_message
from tests.cluster.localnode.prober import ProbeHooks, ProbeTarget, probe_container
from tests.cluster.localnode.simlaunch import SimHostClient, SimWorker, is_worker
from tests.cluster.procs import die_with_parent

log = logging.getLogger("localnode.pod")


@dataclass(frozen=True)
class Backoff:
    """Restart back-off: ``initial`` s doubling to ``maximum`` (the kubelet: 10 s to 300 s)."""

    initial: float = 1.0
    maximum: float = 30.0


class ContainerRunner(ContainerSetup):
    """The runner's part that runs containers and stops them."""

    sim: SimHostClient | None
    backoff: Backoff
    restart_policy: str
    terminating: asyncio.Event
    _procs: dict[str, asyncio.subprocess.Process | SimWorker]

    async def _run_container(self, spec: Obj, st: ContainerStatus, init: bool) -> bool:
        """Run a container per the restart policy; True when it finally succeeded."""
        delay = self.backoff.initial
        policy = "OnFailure" if init and self.restart_policy == "Always" else self.restart_policy
        while True:
            try:
                argv, env, cwd = await self._configure(spec)
            except (ConfigError, volumes.VolumeError, ApiError, ValueError) as exc:
                st.state = {
                    "waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}
                }
                log.warning("pod %s container %s: %s", self.label, spec["name"], exc)
                self.event("Failed", f"Error: {exc}", warning=True, container=spec["name"])
                self._mark()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff.maximum)
                continue
            started = time.monotonic()
            code, reason, message = await self._run_once(spec, st, (argv, env, cwd), init=init)
            if code == 0 and init:
                st.final = True
                self._mark()
                return True
            will_restart = policy == "Always" or (policy == "OnFailure" and code != 0)
            if not will_restart or self.terminating.is_set():
                st.final = True
                self._mark()
                return code == 0
            if time.monotonic() - started > 60:
                delay = self.backoff.initial
            st.last_state = st.state
            st.restart_count += 1
            st.state = {
                "waiting": {
                    "reason": "CrashLoopBackOff",
                    "message": f"back-off {delay:.0f}s restarting failed "
                    f"container={spec['name']} pod={self.name}",
                }
            }
            self._mark()
            self.event(
                "BackOff",
                f"Back-off restarting failed container {spec['name']} in pod {self.name}",
                warning=True,
                container=spec["name"],
            )
            log.info(
                "pod %s container %s exited %s (%s %s); restart in %.1fs",
                self.label,
                spec["name"],
                code,
                reason,
                message,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff.maximum)

    async def _run_once(
        self,
        spec: Obj,
        st: ContainerStatus,
        launch: tuple[list[str], dict[str, str], Path],
        *,
        init: bool,
    ) -> tuple[int, str, str]:
        argv, env, cwd = launch
        name = spec["name"]
        logfile = self._log_path(name)
        with logfile.open("ab") as fh:
            fh.write(
                f"--- localnode: starting {name} (restart {st.restart_count}): {argv}\n".encode()
            )
            fh.flush()
            log_start = fh.tell()
            proc: asyncio.subprocess.Process | SimWorker
            try:
                if self.sim is not None and is_worker(argv):
                    key = f"{self.uid}/{name}/{st.restart_count}"
                    proc = await self.sim.launch(key, argv, env)
                    fh.write(
                        f"--- localnode: served by simulated worker host pid {proc.pid} "
                        f"(its log: {self.sim.log_path})\n".encode()
                    )
                else:
                    proc = await asyncio.create_subprocess_exec(
                        *die_with_parent(argv),
                        env=env,
                        cwd=cwd,
                        stdin=asyncio.subprocess.DEVNULL,
                        stdout=fh,
                        stderr=asyncio.subprocess.STDOUT,
                        start_new_session=True,
                    )
            except OSError as exc:
                now = now_rfc3339()
                st.state = {
                    "terminated": {
                        "exitCode": 128,
                        "reason": "StartError",
                        "message": str(exc),
                        "startedAt": now,
                        "finishedAt": now,
                    }
                }
                self._mark()
                return 128, "StartError", str(exc)
        self._procs[name] = proc
        started_at = now_rfc3339()
        st.pid = proc.pid
        st.state = {"running": {"startedAt": started_at}}
        has_startup = "startupProbe" in spec and not init
        st.started = not has_startup
        st.ready = init is False and "readinessProbe" not in spec and not has_startup
        self._mark()
        self.event("Started", f"Started container {name} (pid {proc.pid})", container=name)
        log.info(
            "pod %s container %s running pid %d on %s", self.label, name, proc.pid, self.pod_ip
        )
        probes = []
        if not init:
            hooks = ProbeHooks(
                mark=self._mark,
                kill=functools.partial(self._kill, proc, spec),
                warn=functools.partial(self._warn, name),
            )
            target = ProbeTarget(spec=spec, pod_ip=self.pod_ip, env=env, cwd=cwd)
            probes.append(asyncio.create_task(probe_container(target, st, hooks)))
        code = await proc.wait()
        if isinstance(proc, SimWorker) and proc.message:
            with logfile.open("ab") as fh:
                fh.write(proc.message.encode() + b"\n")
        for task in probes:
            task.cancel()
        self._procs.pop(name, None)
        st.ready = False
        st.started = False
        reason = "Completed" if code == 0 else "Error"
        if code < 0:
            code = 128 - code  # killed by signal N: 128+N as the runtime reports it
        message = await asyncio.to_thread(self._termination_message, spec, code, log_start)
        terminated: Obj = {
            "exitCode": code,
            "reason": reason,
            "startedAt": started_at,
            "finishedAt": now_rfc3339(),
            "containerID": f"localnode://{proc.pid}",
        }
        if message:
            terminated["message"] = message
        st.state = {"terminated": terminated}
        self._mark()
        return code, reason, message

    def _termination_message(self, spec: Obj, code: int, log_start: int) -> str:
        """The container's termination message (file, or log tail per its policy)."""
        try:
            text = self._termination_file(spec).read_bytes().decode(errors="replace")
        except OSError:
            text = ""
        log_bytes = b""
        with contextlib.suppress(OSError), self._log_path(spec["name"]).open("rb") as fh:
            end = fh.seek(0, os.SEEK_END)
            fh.seek(max(log_start, end - 65536))  # the tail is at most 2048 bytes
            log_bytes = fh.read()
        policy = spec.get("terminationMessagePolicy") or "File"
        return termination_message(policy, code, text, log_bytes)

    async def _kill(
        self,
        proc: asyncio.subprocess.Process | SimWorker,
        spec: Obj,
        why: str,
        grace: float | None = None,
    ) -> None:
        log.info("pod %s container %s: %s, killing", self.label, spec["name"], why)
        self.event(
            "Killing",
            f"Container {spec['name']} {why}, will be restarted",
            warning=True,
            container=spec["name"],
        )
        await _stop_process(
            proc,
            float(
                grace
                if grace is not None
                else self.pod["spec"].get("terminationGracePeriodSeconds", 30)
            ),
        )

    async def _stop_all(self, grace: float) -> None:
        procs = list(self._procs.values())
        if procs:
            log.info("pod %s: stopping %d process(es), grace %.0fs", self.label, len(procs), grace)
            for name in self._procs:
                self.event("Killing", f"Stopping container {name}", container=name)
        await asyncio.gather(*(_stop_process(p, grace) for p in procs))
        for st in self.statuses + self.init_statuses:
            st.ready = False
            st.final = True


async def _stop_process(proc: asyncio.subprocess.Process | SimWorker, grace: float) -> None:
    """SIGTERM the process group, wait ``grace`` seconds, then SIGKILL it."""
    if isinstance(proc, SimWorker):
        await proc.stop(grace)
        return
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(proc.wait()), grace)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    if proc.returncode is None:
        await proc.wait()
