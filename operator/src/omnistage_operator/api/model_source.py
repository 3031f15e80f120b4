"""``spec.model.source``: an init container that fetches the model into the model volume.

Exactly one of:

- ``hub``: a Hugging Face-compatible hub (``url``, ``repo``, ``revision`` default ``main``,
  optional ``tokenSecret`` {``name``, ``key`` default ``token``}), fetched by
  ``python3 -m omnistage_worker.fetch``;
- ``s3``: an S3-compatible object store (``endpoint``, ``bucket``, ``prefix``, ``region``
  default ``us-east-1``, ``pathStyle`` default false, optional ``credentialsSecret``
  {``name``, ``accessKeyIdKey`` default ``AWS_ACCESS_KEY_ID``, ``secretAccessKeyKey`` default
  ``AWS_SECRET_ACCESS_KEY``}), fetched by ``python3 -m omnistage_worker.fetch_s3``.

The pod then gets an init container ``omnistage-model`` (the stage's image) that mounts the
model volume read-write at ``spec.model.mountPath`` and fills ``spec.model.path`` before the
worker starts; the worker mounts it read-only as before. The fetchers cache in that directory
(by commit, by ETag), so with a volume that outlives the pod (a PersistentVolumeClaim) a
replaced pod downloads nothing. Without ``spec.model.volume`` the model goes to an
``emptyDir`` (fetched again by every new pod). Pure logic, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, TypeAlias

__all__ = [
    "FETCH_COMMAND",
    "FETCH_S3_COMMAND",
    "INIT_CONTAINER",
    "HubSource",
    "ModelSource",
    "ModelSourceError",
    "S3Source",
    "parse_model_source",
    "source_hash_fields",
    "source_init_container",
]

INIT_CONTAINER: Final = "omnistage-model"
FETCH_COMMAND: Final = ("python3", "-m", "omnistage_worker.fetch")
FETCH_S3_COMMAND: Final = ("python3", "-m", "omnistage_worker.fetch_s3")
DEFAULT_REVISION: Final = "main"
DEFAULT_TOKEN_KEY: Final = "token"
DEFAULT_REGION: Final = "us-east-1"
DEFAULT_ACCESS_KEY_ID_KEY: Final = "AWS_ACCESS_KEY_ID"
DEFAULT_SECRET_ACCESS_KEY_KEY: Final = "AWS_SECRET_ACCESS_KEY"
_REPO: Final = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")
_URL: Final = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_BUCKET: Final = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_REGION: Final = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")
_SOURCE: Final = "spec.model.source"
_PATH: Final = "spec.model.source.hub"
_S3: Final = "spec.model.source.s3"


class ModelSourceError(ValueError):
    """An invalid ``spec.model.source`` field; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class HubSource:
    """A hub repository at a revision, with an optional token Secret."""

    url: str
    repo: str
    revision: str = DEFAULT_REVISION
    token_secret: str | None = None
    token_key: str = DEFAULT_TOKEN_KEY


@dataclass(frozen=True)
class S3Source:
    """Objects under a prefix of an S3 bucket, with an optional credentials Secret."""

    endpoint: str
    bucket: str
    prefix: str = ""
    region: str = DEFAULT_REGION
    path_style: bool = False
    credentials_secret: str | None = None
    access_key_id_key: str = DEFAULT_ACCESS_KEY_ID_KEY
    secret_access_key_key: str = DEFAULT_SECRET_ACCESS_KEY_KEY


ModelSource: TypeAlias = HubSource | S3Source


def _text(
    block: Mapping[str, Any], key: str, pattern: re.Pattern[str] | None = None, path: str = _PATH
) -> str:
    value = block.get(key)
    if not isinstance(value, str) or not value or (pattern and not pattern.match(value)):
        raise ModelSourceError(f"{path}.{key}", f"is required and must be valid, got {value!r}")
    return value


def _secret(block: Mapping[str, Any], key: str, path: str) -> dict[str, Any]:
    secret = block.get(key)
    if secret is not None and (not isinstance(secret, Mapping) or not secret.get("name")):
        raise ModelSourceError(f"{path}.{key}", "must be an object with a name")
    return dict(secret or {})


def parse_model_source(model: Mapping[str, Any]) -> ModelSource | None:
    """``spec.model.source`` of a ``spec.model`` mapping (None when absent)."""
    source = model.get("source")
    if source is None:
        return None
    if not isinstance(source, Mapping) or (source.get("hub") is None) == (source.get("s3") is None):
        raise ModelSourceError(_SOURCE, "must set exactly one of hub and s3")
    claim = (model.get("volume") or {}).get("persistentVolumeClaim") or {}
    if claim.get("readOnly") is True:
        raise ModelSourceError(
            "spec.model.volume.persistentVolumeClaim.readOnly",
            "must not be true with spec.model.source (the fetcher writes the model there)",
        )
    if source.get("s3") is not None:
        return _parse_s3(source["s3"])
    hub = source["hub"]
    if not isinstance(hub, Mapping):
        raise ModelSourceError(_PATH, "must be an object {url, repo, ...}")
    token = _secret(hub, "tokenSecret", _PATH)
    return HubSource(
        url=_text(hub, "url", _URL),
        repo=_text(hub, "repo", _REPO),
        revision=str(hub.get("revision") or DEFAULT_REVISION),
        token_secret=str(token["name"]) if token.get("name") else None,
        token_key=str(token.get("key") or DEFAULT_TOKEN_KEY),
    )


def _parse_s3(s3: Any) -> S3Source:
    if not isinstance(s3, Mapping):
        raise ModelSourceError(_S3, "must be an object {endpoint, bucket, ...}")
    prefix = s3.get("prefix") or ""
    if not isinstance(prefix, str):
        raise ModelSourceError(f"{_S3}.prefix", f"must be a string, got {prefix!r}")
    path_style = s3.get("pathStyle", False)
    if not isinstance(path_style, bool):
        raise ModelSourceError(f"{_S3}.pathStyle", f"must be true or false, got {path_style!r}")
    secret = _secret(s3, "credentialsSecret", _S3)
    return S3Source(
        endpoint=_text(s3, "endpoint", _URL, _S3),
        bucket=_text(s3, "bucket", _BUCKET, _S3),
        prefix=prefix,
        region=_text(s3, "region", _REGION, _S3) if "region" in s3 else DEFAULT_REGION,
        path_style=path_style,
        credentials_secret=str(secret["name"]) if secret else None,
        access_key_id_key=str(secret.get("accessKeyIdKey") or DEFAULT_ACCESS_KEY_ID_KEY),
        secret_access_key_key=str(
            secret.get("secretAccessKeyKey") or DEFAULT_SECRET_ACCESS_KEY_KEY
        ),
    )


def source_hash_fields(source: ModelSource) -> list[object]:
    """What of ``source`` the pod spec hash covers (a hub source's list is the one it had
    before S3 existed, so those pods keep their hash)."""
    if isinstance(source, HubSource):
        return [source.url, source.repo, source.revision, source.token_secret, source.token_key]
    return [
        "s3", source.endpoint, source.bucket, source.prefix, source.region, source.path_style,
        source.credentials_secret, source.access_key_id_key, source.secret_access_key_key,
    ]  # fmt: skip


def _fetch_args(source: ModelSource, dest: str) -> tuple[list[str], list[dict[str, Any]]]:
    """The init container's command + args and its env (Secret references)."""
    if isinstance(source, HubSource):
        args = [*FETCH_COMMAND, "--hub", source.url, "--repo", source.repo,
                "--revision", source.revision, "--dest", dest]  # fmt: skip
        if source.token_secret is None:
            return args, []
        ref = {"name": source.token_secret, "key": source.token_key}
        return args, [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]
    args = [*FETCH_S3_COMMAND, "--endpoint", source.endpoint, "--bucket", source.bucket,
            "--prefix", source.prefix, "--region", source.region,
            *(["--path-style"] if source.path_style else []), "--dest", dest]  # fmt: skip
    if source.credentials_secret is None:
        return args, []
    env = [
        {
            "name": name,
            "valueFrom": {"secretKeyRef": {"name": source.credentials_secret, "key": key}},
        }
        for name, key in (
            ("AWS_ACCESS_KEY_ID", source.access_key_id_key),
            ("AWS_SECRET_ACCESS_KEY", source.secret_access_key_key),
        )
    ]
    return args, env


def source_init_container(
    source: ModelSource,
    *,
    image: str,
    volume: str,
    mount_path: str,
    dest: str,
    security_context: Mapping[str, Any],
) -> dict[str, Any]:
    """The init container that fetches ``source`` into ``dest`` (on ``volume``, read-write)."""
    command, env = _fetch_args(source, dest)
    container: dict[str, Any] = {
        "name": INIT_CONTAINER,
        "image": image,
        "command": command[:3],
        "args": command[3:],
        "volumeMounts": [{"name": volume, "mountPath": mount_path}],
        "securityContext": dict(security_context),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if env:
        container["env"] = env
    return container
