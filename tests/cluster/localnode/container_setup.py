"""How a pod's container is set up before it runs: its argv (``$(VAR)``-expanded, mount paths
rewritten, the executable found on PATH), its env (the host's few inherited settings, the spec's
values and references, fake or real GPUs from its ResourceClaims) and its working directory."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import time
from pathlib import Path

from tests.cluster.localnode import volumes
from tests.cluster.localnode.api import Obj
from tests.cluster.localnode.devices import (
    GPU_ENV_KEYS,
    claim_devices,
    gpu_env,
    parse_visible_devices,
)
from tests.cluster.localnode.expand import expand, rewrite_path
from tests.cluster.localnode.pod_reporting import PodReporting

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


def search_path() -> str:
    """PATH for containers: the venv's bin first, then localnode's PATH."""
    return os.pathsep.join(
        [str(Path(sys.executable).parent), os.environ.get("PATH", "/usr/bin:/bin")]
    )


class ContainerSetup(PodReporting):
    """The runner's part that turns a container's spec into what runs."""

    state_dir: Path
    _volume_dirs: dict[str, Path]
    _sa_kubeconfig: Path | None

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
