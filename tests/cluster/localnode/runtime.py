"""Run one bound pod as local processes: env, volumes, fake GPUs, probes, restarts, status.

A container's ``command`` + ``args`` (``$(VAR)``-expanded, mount paths rewritten) run with the
pod's env in their own process group, stdout and stderr appended to a log file whose path is
recorded in the pod annotation ``localnode.omnistage.io/log-<container>``. The executable is
looked up on PATH with the directory of ``sys.executable`` first; ``image`` is ignored, so a
container without ``command`` cannot run (it is reported as a StartError).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.cluster.kubeconfig import write_token_kubeconfig
from tests.cluster.localnode import volumes
from tests.cluster.localnode.api import Api, ApiError, Obj
from tests.cluster.localnode.devices import (
    GPU_ENV_KEYS,
    NodeSpec,
    claim_devices,
    gpu_env,
    parse_visible_devices,
)
from tests.cluster.localnode.events import pod_event
from tests.cluster.localnode.expand import expand, rewrite_path
from tests.cluster.localnode.podstatus import (
    ContainerStatus,
    now_rfc3339,
    pod_conditions,
    pod_phase,
    termination_message,
)
from tests.cluster.localnode.prober import ProbeHooks, ProbeTarget, probe_container
from tests.cluster.localnode.simlaunch import SimHostClient, SimWorker, is_worker
from tests.cluster.procs import die_with_parent

log = logging.getLogger("localnode.pod")

LOG_ANNOTATION = "localnode.omnistage.io/log-"
# what a container inherits from localnode's own environment (its "image")
INHERITED_ENV = (
    "HOME",
    "LANG",
    "LC_ALL",
    "TMPDIR",
    "PYTHONPATH",
    "VIRTUAL_ENV",
    "OMNISTAGE_CACHE",
    "LD_LIBRARY_PATH",
)
# per-pod device visibility: never inherited, set from the pod's allocation
_VISIBILITY = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
_GPU_HOST_PREFIXES = ("CUDA_", "NVIDIA_", "NCCL_", "NVSHMEM_", "TORCH_SYMM_MEM_")
DEFAULT_TERMINATION_PATH = "/dev/termination-log"


def runtime_env(host: dict[str, str] | os._Environ[str], real_gpus: bool) -> dict[str, str]:
    """What a container gets from the host beside its spec's env (a runtime on a GPU host).

    Always the few settings a local process needs (``INHERITED_ENV``, ``LD_LIBRARY_PATH``
    among them); with real GPUs also the host's ``CUDA_*`` and ``NVIDIA_*`` driver settings
    and its ``NCCL_*``/``NVSHMEM_*``/``TORCH_SYMM_MEM_*`` safety switches (a GPU host may
    require NVLink multicast off in every program), except device visibility, which comes
    from the pod's allocation only.
    """
    env = {k: host[k] for k in INHERITED_ENV if k in host}
    if real_gpus:
        env.update(
            (k, v)
            for k, v in host.items()
            if k.startswith(_GPU_HOST_PREFIXES) and k not in _VISIBILITY
        )
    return env


class ConfigError(RuntimeError):
    """The container cannot be configured (missing Secret key, unknown device...)."""


@dataclass(frozen=True)
class Backoff:
    """Restart back-off: ``initial`` s doubling to ``maximum`` (the kubelet: 10 s to 300 s)."""

    initial: float = 1.0
    maximum: float = 30.0


def search_path() -> str:
    """PATH for containers: the venv's bin first, then localnode's PATH."""
    return os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
    )


class PodRunner:
    """Runs one pod until it ends or is deleted."""

    def __init__(
        self,
        api: Api,
        pod: Obj,
        node: NodeSpec,
        *,
        pod_ip: str,
        state_dir: Path,
        backoff: Backoff,
        on_done: Callable[[PodRunner, bool], None],
        deletion_held: Callable[[str, str], bool] = lambda ns, name: False,
        sim: SimHostClient | None = None,
    ):
        """``sim``: the simulated host that serves this pod's worker containers (None: each
        container is a process)."""
        self.api = api
        self.sim = sim
        self.pod = pod
        self.node = node
        self.pod_ip = pod_ip
        self.state_dir = state_dir
        self.backoff = backoff
        self._on_done = on_done
        self._deletion_held = deletion_held
        self._hold: asyncio.Task[None] | None = None
        self._held_delete_object = True
        meta = pod["metadata"]
        self.uid: str = meta["uid"]
        self.ns: str = meta["namespace"]
        self.name: str = meta["name"]
        self.dir = state_dir / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        spec = pod["spec"]
        self.restart_policy: str = spec.get("restartPolicy", "Always")
        self.init_specs: list[Obj] = list(spec.get("initContainers") or [])
        self.specs: list[Obj] = list(spec.get("containers") or [])
        self.init_statuses = [
            ContainerStatus(c["name"], c.get("image", "")) for c in self.init_specs
        ]
        self.statuses = [ContainerStatus(c["name"], c.get("image", "")) for c in self.specs]
        self.init_done = not self.init_specs
        self.init_failed = False
        self.terminating = asyncio.Event()
        self._procs: dict[str, asyncio.subprocess.Process | SimWorker] = {}
        self._dirty = asyncio.Event()
        self._status_written = asyncio.Event()
        self._start_time = now_rfc3339()
        self._volume_dirs: dict[str, Path] = {}
        self._task: asyncio.Task[None] | None = None
        self.delete_object = True
        self._sa_kubeconfig: Path | None = None
        self._event_tasks: set[asyncio.Task[None]] = set()

    @property
    def label(self) -> str:
        """``namespace/name`` for logs."""
        return f"{self.ns}/{self.name}"

    def start(self) -> None:
        """Start running the pod in the background."""
        self._task = asyncio.create_task(self._main(), name=f"pod {self.label}")

    def update(self, pod: Obj) -> None:
        """A newer version of the pod object arrived from the watch."""
        self.pod = pod
        if pod["metadata"].get("deletionTimestamp"):
            self.terminate(delete_object=True)

    def terminate(self, delete_object: bool, *, force: bool = False) -> None:
        """Begin termination (idempotent); delete the object afterwards if asked.

        While the kubelet fault ``hold_deletions`` names this pod (and not ``force``), nothing
        happens: the process keeps running and the object stays Terminating until released.
        """
        if not force and self._deletion_held(self.ns, self.name):
            self._held_delete_object = self._held_delete_object and delete_object
            if self._hold is None:
                log.info("pod %s: deletion held (kubelet fault): it keeps running", self.label)
                self._hold = asyncio.create_task(self._release_when_unheld())
            return
        self.delete_object = self.delete_object and delete_object
        self.terminating.set()

    async def _release_when_unheld(self) -> None:
        # the switch is a file the test process writes: poll it
        while self._deletion_held(self.ns, self.name) and not self.terminating.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        log.info("pod %s: deletion released", self.label)
        self.delete_object = self.delete_object and self._held_delete_object
        self.terminating.set()

    async def wait(self) -> None:
        """Wait until the pod's processes are gone and the runner finished."""
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # ---- main ------------------------------------------------------------------------------
    async def _main(self) -> None:
        writer = asyncio.create_task(self._status_writer())
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            await self._annotate_logs()
            self._mark()
            run = asyncio.create_task(self._run_all())
            term = asyncio.create_task(self.terminating.wait())
            await asyncio.wait({run, term}, return_when=asyncio.FIRST_COMPLETED)
            if not run.done():
                await self._stop_all(self._grace())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(run), 2)
                run.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await run
            else:
                # the pod ended by itself: its address is free (as when the kubelet tears down
                # the sandbox); the runner stays until the pod is deleted
                self._on_done(self, False)
                await term
                await self._stop_all(self._grace())
        except Exception:
            log.exception("pod %s: runner failed", self.label)
            await self._stop_all(0)
        finally:
            self._mark()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._flush_status(), 5)
            writer.cancel()
            if self.delete_object and self.terminating.is_set():
                await self._delete_object()
            self._on_done(self, True)

    def _grace(self) -> float:
        meta = self.pod["metadata"]
        if meta.get("deletionGracePeriodSeconds") is not None:
            return float(meta["deletionGracePeriodSeconds"])
        return float(self.pod["spec"].get("terminationGracePeriodSeconds", 30))

    async def _delete_object(self) -> None:
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": self.uid},
        }
        try:
            await self.api.delete(f"/api/v1/namespaces/{self.ns}/pods/{self.name}", body)
            log.info("pod %s: processes gone, object deleted", self.label)
        except ApiError as exc:
            if exc.status != 409:  # 409: a newer pod of the same name
                log.warning("pod %s: delete failed: %s", self.label, exc)

    async def _annotate_logs(self) -> None:
        notes = {
            f"{LOG_ANNOTATION}{c['name']}"[:253]: str(self._log_path(c["name"]))
            for c in self.init_specs + self.specs
        }
        with contextlib.suppress(ApiError):
            await self.api.patch(
                f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
                {"metadata": {"annotations": notes}},
            )

    def _log_path(self, container: str) -> Path:
        return self.dir / f"{container}.log"

    async def _run_all(self) -> None:
        await self._prepare_volumes()
        for spec, st in zip(self.init_specs, self.init_statuses, strict=True):
            ok = await self._run_container(spec, st, init=True)
            if not ok:
                self.init_failed = True
                self._mark()
                return
        self.init_done = True
        self._mark()
        await asyncio.gather(
            *(
                self._run_container(spec, st, init=False)
                for spec, st in zip(self.specs, self.statuses, strict=True)
            )
        )

    async def _prepare_volumes(self) -> None:
        delay = self.backoff.initial
        while True:
            try:
                for vol in self.pod["spec"].get("volumes") or []:
                    self._volume_dirs[vol["name"]] = await volumes.realize_volume(
                        self.api,
                        self.pod,
                        vol,
                        pod_dir=self.dir,
                        state_dir=self.state_dir,
                        pod_ip=self.pod_ip,
                        host_ip=self.node.address,
                    )
                self._write_sa_kubeconfig()
                return
            except (volumes.VolumeError, ApiError) as exc:
                msg = f"MountVolume.SetUp failed: {exc}"
                log.warning("pod %s: %s", self.label, msg)
                self.event("FailedMount", msg, warning=True)
                for st in self.init_statuses + self.statuses:
                    st.state = {"waiting": {"reason": "ContainerCreating", "message": msg}}
                self._mark()
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.backoff.maximum)

    def _write_sa_kubeconfig(self) -> None:
        """Write a kubeconfig acting as the pod's ServiceAccount (from its projected token).

        A real pod finds the API through KUBERNETES_SERVICE_HOST and the token mounted at
        /var/run/secrets/kubernetes.io/serviceaccount; a local process cannot have that path,
        so containers get ``KUBECONFIG`` pointing here instead (clients fall back to it).
        """
        for vol in self.pod["spec"].get("volumes") or []:
            sources = (vol.get("projected") or {}).get("sources") or []
            token_src = next((s for s in sources if "serviceAccountToken" in s), None)
            if token_src is None:
                continue
            vdir = self._volume_dirs[vol["name"]]
            token = (vdir / token_src["serviceAccountToken"]["path"]).read_text().strip()
            ca = vdir / "ca.crt"
            path = self.dir / "serviceaccount.kubeconfig"
            sa = self.pod["spec"].get("serviceAccountName") or "default"
            write_token_kubeconfig(
                path,
                self.api.auth.server,
                ca if ca.is_file() else self.api.auth.ca_file,
                token,
                f"{self.ns}-{sa}",
                namespace=self.ns,
            )
            self._sa_kubeconfig = path
            return

    # ---- containers ------------------------------------------------------------------------
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

    def _termination_file(self, spec: Obj) -> Path:
        return self.dir / f"{spec['name']}.termination-log"

    async def _configure(self, spec: Obj) -> tuple[list[str], dict[str, str], Path]:
        mounts = volumes.mount_map(spec, self._volume_dirs)
        # the termination-message file, as the kubelet mounts it (a fresh empty file per run)
        msg_path = spec.get("terminationMessagePath") or DEFAULT_TERMINATION_PATH
        msg_file = self._termination_file(spec)
        msg_file.write_bytes(b"")
        mounts.setdefault(msg_path, str(msg_file))
        env = await self._env(spec, mounts)
        command = list(spec.get("command") or [])
        if not command:
            raise ConfigError(
                f"container {spec['name']!r} has no command: localnode ignores images, "
                "so every container needs one"
            )
        argv = [
            rewrite_path(expand(a, env), mounts) for a in command + list(spec.get("args") or [])
        ]
        exe = argv[0]
        if os.sep not in exe:
            found = shutil.which(exe, path=env["PATH"])
            if found is None:
                raise ConfigError(f'executable "{exe}" not found on PATH {env["PATH"]}')
            argv[0] = found
        cwd = Path(rewrite_path(spec["workingDir"], mounts)) if spec.get("workingDir") else self.dir
        cwd.mkdir(parents=True, exist_ok=True)
        return argv, env, cwd

    async def _env(self, spec: Obj, mounts: dict[str, str]) -> dict[str, str]:
        base = runtime_env(os.environ, self.node.real)
        base["PATH"] = search_path()
        base["HOSTNAME"] = self.name
        env: dict[str, str] = {}
        for source in spec.get("envFrom") or []:
            env.update(await volumes.env_from(self.api, self.ns, source))
        for var in spec.get("env") or []:
            name = var["name"]
            if "valueFrom" in var:
                value = await self._value_from(var["valueFrom"], spec)
                if value is None:
                    continue
            else:
                value = expand(str(var.get("value", "")), {**base, **env})
            env[name] = rewrite_path(value, mounts)
        devices = await self._devices(spec, env)
        full = {**base, **env}
        if self._sa_kubeconfig is not None and "KUBECONFIG" not in env:
            full["KUBECONFIG"] = str(self._sa_kubeconfig)
        if devices:
            full.update(gpu_env(self.node, devices, self.state_dir))
        elif self.node.real:
            full["CUDA_VISIBLE_DEVICES"] = ""  # no device allocated: no GPU in this container
        else:
            for key in GPU_ENV_KEYS:
                if key not in env:
                    full.pop(key, None)
        return full

    async def _value_from(self, src: Obj, spec: Obj) -> str | None:
        if "fieldRef" in src:
            return volumes.field_value(
                self.pod, src["fieldRef"]["fieldPath"], self.pod_ip, self.node.address
            )
        if "secretKeyRef" in src:
            return await volumes.secret_key(self.api, self.ns, src["secretKeyRef"])
        if "configMapKeyRef" in src:
            return await volumes.configmap_key(self.api, self.ns, src["configMapKeyRef"])
        if "resourceFieldRef" in src:
            res = src["resourceFieldRef"]["resource"]
            kind, _, name = res.partition(".")
            value = ((spec.get("resources") or {}).get(kind) or {}).get(name)
            return str(value) if value is not None else "0"
        raise ConfigError(f"unsupported valueFrom {sorted(src)}")

    async def _devices(self, spec: Obj, env: dict[str, str]) -> list[str]:
        """Fake GPUs: from the container's allocated ResourceClaims, else NVIDIA_VISIBLE_DEVICES."""
        refs = (spec.get("resources") or {}).get("claims") or []
        if refs:
            devices: list[str] = []
            for ref in refs:
                claim = await self._claim(ref["name"])
                request = ref.get("request")
                devices += claim_devices(claim, self.node.name, [request] if request else None)
            if devices:
                return devices
        explicit = env.get("NVIDIA_VISIBLE_DEVICES")
        if explicit is not None:
            return parse_visible_devices(explicit, self.node)
        return []

    async def _claim(self, pod_claim_name: str) -> Obj:
        deadline = time.monotonic() + 30
        while True:
            name = self._claim_object_name(pod_claim_name)
            if name:
                claim = await self.api.get_or_none(
                    f"/apis/resource.k8s.io/v1/namespaces/{self.ns}/resourceclaims/{name}"
                )
                if claim and (claim.get("status") or {}).get("allocation"):
                    return claim
            if time.monotonic() > deadline:
                raise ConfigError(
                    f"ResourceClaim for pod claim {pod_claim_name!r} is not allocated"
                )
            await asyncio.sleep(0.5)
            fresh = await self.api.get_or_none(f"/api/v1/namespaces/{self.ns}/pods/{self.name}")
            if fresh:
                self.pod = fresh

    def _claim_object_name(self, pod_claim_name: str) -> str | None:
        for ref in self.pod["spec"].get("resourceClaims") or []:
            if ref["name"] != pod_claim_name:
                continue
            if ref.get("resourceClaimName"):
                return str(ref["resourceClaimName"])
            for st in (self.pod.get("status") or {}).get("resourceClaimStatuses") or []:
                if st.get("name") == pod_claim_name and st.get("resourceClaimName"):
                    return str(st["resourceClaimName"])
            return None
        raise ConfigError(
            f"container references pod claim {pod_claim_name!r}, which spec.resourceClaims lacks"
        )

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

    # ---- events ----------------------------------------------------------------------------
    def event(
        self, reason: str, message: str, *, warning: bool = False, container: str = ""
    ) -> None:
        """Record a kubelet-style Event on the pod (best effort, in the background)."""
        body = pod_event(
            self.pod,
            self.node.name,
            reason,
            message,
            now_rfc3339(),
            warning=warning,
            container=container,
        )
        task = asyncio.create_task(self._post_event(body))
        self._event_tasks.add(task)
        task.add_done_callback(self._event_tasks.discard)

    def _warn(self, container: str, reason: str, message: str) -> None:
        self.event(reason, message, warning=True, container=container)

    async def _post_event(self, body: Obj) -> None:
        with contextlib.suppress(Exception):
            await self.api.create(f"/api/v1/namespaces/{self.ns}/events", body)

    # ---- status ----------------------------------------------------------------------------
    def _mark(self) -> None:
        self._status_written.clear()
        self._dirty.set()

    async def _flush_status(self) -> None:
        self._mark()
        await self._status_written.wait()

    async def _status_writer(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._write_status()
            except ApiError as exc:
                if exc.status == 404:
                    self._status_written.set()
                    return
                log.warning("pod %s: status update failed: %s", self.label, exc)
                await asyncio.sleep(0.5)
                self._dirty.set()
                continue
            except Exception as exc:
                log.warning("pod %s: status update failed: %s", self.label, exc)
                await asyncio.sleep(0.5)
                self._dirty.set()
                continue
            if not self._dirty.is_set():
                self._status_written.set()
            await asyncio.sleep(0.05)

    async def _write_status(self) -> None:
        now = now_rfc3339()
        previous = (self.pod.get("status") or {}).get("conditions") or []
        gates = [g["conditionType"] for g in self.pod["spec"].get("readinessGates") or []]
        status: dict[str, Any] = {
            "phase": pod_phase(self.init_done, self.init_failed, self.statuses),
            "podIP": self.pod_ip,
            "podIPs": [{"ip": self.pod_ip}],
            "hostIP": self.node.address,
            "hostIPs": [{"ip": self.node.address}],
            "startTime": self._start_time,
            "conditions": pod_conditions(previous, self.init_done, self.statuses, gates, now),
            "containerStatuses": [s.render() for s in self.statuses],
        }
        if self.init_statuses:
            status["initContainerStatuses"] = [s.render() for s in self.init_statuses]
        updated = await self.api.patch(
            f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
            {"status": status},
            patch="strategic",
        )
        if updated.get("metadata", {}).get("uid") == self.uid:
            self.pod = {**self.pod, "status": updated.get("status", {})}


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
