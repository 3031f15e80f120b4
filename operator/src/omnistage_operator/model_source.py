"""``spec.model.source``: an init container that fetches the model into the model volume.

``spec.model.source.hub`` names a Hugging Face-compatible hub (``url``, ``repo``,
``revision`` default ``main``, optional ``tokenSecret`` {``name``, ``key`` default ``token``}).
The pod then gets an init container ``omnistage-model`` (the stage's image, running
``python3 -m omnistage_worker.fetch``, :mod:`omnistage_worker.fetch`) that mounts the model
volume read-write at ``spec.model.mountPath`` and fills ``spec.model.path`` before the worker
starts; the worker mounts it read-only as before. The fetcher caches by commit in that
directory, so with a volume that outlives the pod (a PersistentVolumeClaim) a replaced pod
downloads nothing. Without ``spec.model.volume`` the model goes to an ``emptyDir`` (fetched
again by every new pod). Pure logic, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

__all__ = [
    "FETCH_COMMAND",
    "INIT_CONTAINER",
    "ModelSource",
    "ModelSourceError",
    "parse_model_source",
    "source_init_container",
]

INIT_CONTAINER: Final = "omnistage-model"
FETCH_COMMAND: Final = ("python3", "-m", "omnistage_worker.fetch")
DEFAULT_REVISION: Final = "main"
DEFAULT_TOKEN_KEY: Final = "token"
_REPO: Final = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")
_URL: Final = re.compile(r"^https?://[^\s/]+(/\S*)?$")
_PATH: Final = "spec.model.source.hub"


class ModelSourceError(ValueError):
    """An invalid ``spec.model.source`` field; ``field`` is its dotted path."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


@dataclass(frozen=True)
class ModelSource:
    """A hub repository at a revision, with an optional token Secret."""

    url: str
    repo: str
    revision: str = DEFAULT_REVISION
    token_secret: str | None = None
    token_key: str = DEFAULT_TOKEN_KEY


def _text(hub: Mapping[str, Any], key: str, pattern: re.Pattern[str] | None = None) -> str:
    value = hub.get(key)
    if not isinstance(value, str) or not value or (pattern and not pattern.match(value)):
        raise ModelSourceError(f"{_PATH}.{key}", f"is required and must be valid, got {value!r}")
    return value


def parse_model_source(model: Mapping[str, Any]) -> ModelSource | None:
    """``spec.model.source`` of a ``spec.model`` mapping (None when absent)."""
    source = model.get("source")
    if source is None:
        return None
    if not isinstance(source, Mapping) or not isinstance(source.get("hub"), Mapping):
        raise ModelSourceError(_PATH, "is required (the hub to fetch the model from)")
    hub = source["hub"]
    secret = hub.get("tokenSecret")
    if secret is not None and not isinstance(secret, Mapping):
        raise ModelSourceError(f"{_PATH}.tokenSecret", "must be an object {name, key}")
    token = dict(secret or {})
    claim = (model.get("volume") or {}).get("persistentVolumeClaim") or {}
    if claim.get("readOnly") is True:
        raise ModelSourceError(
            "spec.model.volume.persistentVolumeClaim.readOnly",
            "must not be true with spec.model.source (the fetcher writes the model there)",
        )
    return ModelSource(
        url=_text(hub, "url", _URL),
        repo=_text(hub, "repo", _REPO),
        revision=str(hub.get("revision") or DEFAULT_REVISION),
        token_secret=str(token["name"]) if token.get("name") else None,
        token_key=str(token.get("key") or DEFAULT_TOKEN_KEY),
    )


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
    container: dict[str, Any] = {
        "name": INIT_CONTAINER,
        "image": image,
        "command": list(FETCH_COMMAND),
        "args": [
            "--hub",
            source.url,
            "--repo",
            source.repo,
            "--revision",
            source.revision,
            "--dest",
            dest,
        ],
        "volumeMounts": [{"name": volume, "mountPath": mount_path}],
        "securityContext": dict(security_context),
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if source.token_secret is not None:
        ref = {"name": source.token_secret, "key": source.token_key}
        container["env"] = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": ref}}]
    return container
