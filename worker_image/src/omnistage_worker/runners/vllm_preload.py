"""Imported in the fork server of :mod:`.vllm_forkserver`, never by the worker: what vLLM's
engine core imports, so that a child forked from it starts with them imported. A failure leaves
the child to import them itself (and to report the error there); nothing here touches a GPU."""

from __future__ import annotations

import contextlib

with contextlib.suppress(Exception):
    import vllm.v1.engine.core  # noqa: F401

with contextlib.suppress(Exception):
    import omnistage_worker.runners.vllm_wake_cuda  # noqa: F401
