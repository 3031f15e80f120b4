"""Run one bound pod as local processes: env, volumes, fake GPUs, probes, restarts, status.

A container's ``command`` + ``args`` (``$(VAR)``-expanded, mount paths rewritten) run with the
pod's env in their own process group, stdout and stderr appended to a log file whose path is
recorded in the pod annotation ``localnode.omnistage.io/log-<container>``. The executable is
looked up on PATH with the directory of ``sys.executable`` first; ``image`` is ignored, so a
container without ``command`` cannot run (it is reported as a StartError).

The pod's life is here (volumes, the ServiceAccount's kubeconfig, init containers before the
others, termination and deletion); its containers' set-up, runs and restarts are in
:mod:`.container_setup` and :mod:`.container_run`, its Events and status writes in
:mod:`.pod_reporting`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from tests.cluster.kubeconfig import write_token_kubeconfig
from tests.cluster.localnode import volumes
from tests.cluster.localnode.api import Api, ApiError, Obj
from tests.cluster.localnode.container_run import Backoff, ContainerRunner
from tests.cluster.localnode.devices import NodeSpec
from tests.cluster.localnode.podstatus import ContainerStatus, now_rfc3339
from tests.cluster.localnode.simlaunch import SimHostClient, SimWorker

log = logging.getLogger("localnode.pod")

LOG_ANNOTATION = "localnode.omnistage.io/log-"


class PodRunner(ContainerRunner):
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
