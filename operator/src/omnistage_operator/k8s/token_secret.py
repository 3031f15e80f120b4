"""The Secret holding the workers' bearer token, and where a worker finds it (pure, no network).

The token *value* only ever appears in ``build_token_secret``.

Public API (stable):
    ``TOKEN_SECRET_NAME="omnistage-worker-token"``, ``TOKEN_SECRET_KEY="token"``,
    ``TOKEN_FILE`` (``TOKEN_MOUNT_DIR/token``, the worker's ``--token-file``),
    ``TOKEN_SHA256_ANNOTATION``.
    ``build_token_secret(namespace, token, name=TOKEN_SECRET_NAME) -> dict``
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any, Final

from omnistage_operator.api.labels import MANAGED_BY_LABEL, MANAGER
from omnistage_operator.api.spec import TOKEN_MOUNT_DIR

__all__ = [
    "TOKEN_FILE",
    "TOKEN_SECRET_KEY",
    "TOKEN_SECRET_NAME",
    "TOKEN_SHA256_ANNOTATION",
    "build_token_secret",
]

TOKEN_SECRET_NAME: Final = "omnistage-worker-token"
TOKEN_SECRET_KEY: Final = "token"
TOKEN_FILE: Final = f"{TOKEN_MOUNT_DIR}/{TOKEN_SECRET_KEY}"
TOKEN_SHA256_ANNOTATION: Final = "omnistage.io/token-sha256"


def build_token_secret(namespace: str, token: str, name: str = TOKEN_SECRET_NAME) -> dict[str, Any]:
    """The Secret holding the workers' bearer token (base64 ``data``, as the API returns it).

    The ``omnistage.io/token-sha256`` annotation lets the operator see whether the stored
    token is current without decoding it, and never needs logging the token itself.
    """
    if not token:
        raise ValueError("the worker token must not be empty")
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {MANAGED_BY_LABEL: MANAGER},
            "annotations": {TOKEN_SHA256_ANNOTATION: hashlib.sha256(token.encode()).hexdigest()},
        },
        "type": "Opaque",
        "data": {TOKEN_SECRET_KEY: base64.b64encode(token.encode()).decode("ascii")},
    }
