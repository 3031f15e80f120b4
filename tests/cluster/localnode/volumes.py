"""Realize a pod's volumes as local directories (secret/configMap files, emptyDir, hostPath...).

Each volume becomes a directory: secret, configMap, downwardAPI and projected volumes are written
as files under the pod's state dir; emptyDir is a fresh dir there; hostPath is that path;
persistentVolumeClaim is ``<state>/pvc/<namespace>/<claim>`` (shared by every pod using the
claim). ``mount_map`` then maps each container's mountPath (with subPath) to its directory.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path
from typing import Any

from tests.cluster.localnode.api import Api, Obj


class VolumeError(RuntimeError):
    """A volume could not be realized (missing Secret/ConfigMap key, bad hostPath...)."""


def _write_items(
    directory: Path, data: dict[str, bytes], items: list[dict[str, Any]] | None, what: str
) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    if items:
        chosen = {}
        for item in items:
            key = item["key"]
            if key not in data:
                raise VolumeError(f"{what} has no key {key!r}")
            chosen[item.get("path", key)] = data[key]
    else:
        chosen = data
    for rel, content in chosen.items():
        target = directory / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)


async def _secret_data(api: Api, ns: str, name: str, optional: bool) -> dict[str, bytes] | None:
    obj = await api.get_or_none(f"/api/v1/namespaces/{ns}/secrets/{name}")
    if obj is None:
        if optional:
            return None
        raise VolumeError(f'secret "{name}" not found')
    return {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}


async def _configmap_data(api: Api, ns: str, name: str, optional: bool) -> dict[str, bytes] | None:
    obj = await api.get_or_none(f"/api/v1/namespaces/{ns}/configmaps/{name}")
    if obj is None:
        if optional:
            return None
        raise VolumeError(f'configmap "{name}" not found')
    data = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return data


def field_value(pod: Obj, path: str, pod_ip: str, host_ip: str) -> str:
    """The value of a downward-API ``fieldRef.fieldPath`` for ``pod``."""
    meta = pod["metadata"]
    spec = pod["spec"]
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
        "status.podIP": pod_ip,
        "status.podIPs": pod_ip,
        "status.hostIP": host_ip,
        "status.hostIPs": host_ip,
    }
    if path in simple:
        return str(simple[path])
    for kind in ("labels", "annotations"):
        prefix = f"metadata.{kind}['"
        if path.startswith(prefix) and path.endswith("']"):
            return str((meta.get(kind) or {}).get(path[len(prefix) : -2], ""))
        if path == f"metadata.{kind}":
            return "\n".join(f'{k}="{v}"' for k, v in sorted((meta.get(kind) or {}).items()))
    raise VolumeError(f"unsupported fieldRef fieldPath {path!r}")


def _host_dir(path: Path, kind: str, name: str) -> Path:
    if kind == "DirectoryOrCreate":
        path.mkdir(parents=True, exist_ok=True)
    elif kind == "Directory" and not path.is_dir():
        raise VolumeError(f"hostPath {path} of volume {name!r} is not a directory")
    return path


async def realize_volume(
    api: Api,
    pod: Obj,
    volume: Obj,
    *,
    pod_dir: Path,
    state_dir: Path,
    pod_ip: str,
    host_ip: str,
) -> Path:
    """Create the local directory for ``volume`` and return it."""
    ns = str(pod["metadata"]["namespace"])
    name = str(volume["name"])
    target: Path = pod_dir / "volumes" / name
    if "hostPath" in volume:
        spec = volume["hostPath"]
        return _host_dir(Path(spec["path"]), str(spec.get("type", "")), name)
    if "persistentVolumeClaim" in volume:
        claim = str(volume["persistentVolumeClaim"]["claimName"])
        return _host_dir(state_dir / "pvc" / ns / claim, "DirectoryOrCreate", name)
    if "secret" in volume:
        src = volume["secret"]
        data = await _secret_data(api, ns, src["secretName"], bool(src.get("optional")))
        _write_items(target, data or {}, src.get("items"), f'secret "{src["secretName"]}"')
        return target
    if "configMap" in volume:
        src = volume["configMap"]
        data = await _configmap_data(api, ns, src["name"], bool(src.get("optional")))
        _write_items(target, data or {}, src.get("items"), f'configmap "{src["name"]}"')
        return target
    if "downwardAPI" in volume:
        _write_downward(target, pod, volume["downwardAPI"].get("items") or [], pod_ip, host_ip)
        return target
    if "projected" in volume:
        _host_dir(target, "DirectoryOrCreate", name)
        for source in volume["projected"].get("sources") or []:
            await _project(api, pod, source, target, (pod_ip, host_ip))
        return target
    # emptyDir and anything else: a fresh private directory
    return _host_dir(target, "DirectoryOrCreate", name)


def _write_downward(target: Path, pod: Obj, items: list[Obj], pod_ip: str, host_ip: str) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for item in items:
        if "fieldRef" in item:
            value = field_value(pod, item["fieldRef"]["fieldPath"], pod_ip, host_ip)
            (target / item["path"]).write_text(value)


async def _project(api: Api, pod: Obj, source: Obj, target: Path, ips: tuple[str, str]) -> None:
    pod_ip, host_ip = ips
    ns = pod["metadata"]["namespace"]
    if "serviceAccountToken" in source:
        sat = source["serviceAccountToken"]
        sa = pod["spec"].get("serviceAccountName") or "default"
        request: Obj = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "expirationSeconds": int(sat.get("expirationSeconds", 3607)),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": pod["metadata"]["name"],
                    "uid": pod["metadata"]["uid"],
                },
            },
        }
        if sat.get("audience"):
            request["spec"]["audiences"] = [sat["audience"]]
        answer = await api.create(f"/api/v1/namespaces/{ns}/serviceaccounts/{sa}/token", request)
        (target / sat["path"]).write_text(answer["status"]["token"])
    elif "configMap" in source:
        src = source["configMap"]
        data = await _configmap_data(api, ns, src["name"], bool(src.get("optional")))
        _write_items(target, data or {}, src.get("items"), f'configmap "{src["name"]}"')
    elif "secret" in source:
        src = source["secret"]
        data = await _secret_data(api, ns, src["name"], bool(src.get("optional")))
        _write_items(target, data or {}, src.get("items"), f'secret "{src["name"]}"')
    elif "downwardAPI" in source:
        _write_downward(target, pod, source["downwardAPI"].get("items") or [], pod_ip, host_ip)


def mount_map(container: Obj, volume_dirs: dict[str, Path]) -> dict[str, str]:
    """mountPath -> local directory for ``container`` (subPath included)."""
    out: dict[str, str] = {}
    for mount in container.get("volumeMounts") or []:
        base = volume_dirs.get(mount["name"])
        if base is None:
            raise VolumeError(
                f"volumeMount {mount['mountPath']!r} names unknown volume {mount['name']!r}"
            )
        sub = mount.get("subPath")
        out[mount["mountPath"]] = os.fspath(base / sub if sub else base)
    return out


async def secret_key(api: Api, ns: str, ref: Obj) -> str | None:
    """A ``secretKeyRef`` value (None when optional and missing)."""
    data = await _secret_data(api, ns, ref["name"], bool(ref.get("optional")))
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise VolumeError(f"couldn't find key {ref['key']} in Secret {ns}/{ref['name']}")
    return data[ref["key"]].decode()


async def configmap_key(api: Api, ns: str, ref: Obj) -> str | None:
    """A ``configMapKeyRef`` value (None when optional and missing)."""
    data = await _configmap_data(api, ns, ref["name"], bool(ref.get("optional")))
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise VolumeError(f"couldn't find key {ref['key']} in ConfigMap {ns}/{ref['name']}")
    return data[ref["key"]].decode()


async def env_from(api: Api, ns: str, source: Obj) -> dict[str, str]:
    """The variables of one ``envFrom`` entry."""
    prefix = source.get("prefix", "")
    if "secretRef" in source:
        ref = source["secretRef"]
        data = await _secret_data(api, ns, ref["name"], bool(ref.get("optional")))
    else:
        ref = source["configMapRef"]
        data = await _configmap_data(api, ns, ref["name"], bool(ref.get("optional")))
    return {prefix + k: v.decode() for k, v in (data or {}).items()}
