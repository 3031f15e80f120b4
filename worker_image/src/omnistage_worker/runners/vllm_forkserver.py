"""vLLM's engine core started from a fork server that imported vLLM while the worker started.

The worker runs gRPC threads, so vLLM's engine core cannot be forked from it: it was spawned,
and the spawned process imported vLLM again (about 15 s on the H200 host, after the worker's
own import of vLLM, about 14 s). Python's fork server is a process started before any thread
that forks each child on request. :func:`begin` starts it as the worker's flags are parsed, with
vLLM's engine core and this package's engine extension preloaded (:mod:`.vllm_preload`), so the
import runs on another core beside the worker's; :func:`install` makes vLLM start its engine
core from it, and the child starts with those modules already imported.

A forked child keeps the fork server's environment, which is the worker's as it was when the
server started; vLLM sets variables after that (its config, its spawn choice). So the child
takes the worker's environment as it is when the child starts (:class:`EnvSnapshotProcess`).

The fork server stays up while the worker lives: the engine core is its child, so the worker's
process tree (what NVML figures are matched against) keeps holding the engine.
``OMNISTAGE_VLLM_FORKSERVER=0`` keeps vLLM's own spawn.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import multiprocessing.forkserver
import os
from collections.abc import Sequence
from multiprocessing.context import ForkServerContext, ForkServerProcess
from typing import Any

log = logging.getLogger(__name__)

ENV = "OMNISTAGE_VLLM_FORKSERVER"
PRELOAD = ("omnistage_worker.runners.vllm_preload",)
ENGINE_UTILS = "vllm.v1.engine.utils"  # where vLLM 0.24 takes the engine core's start method


def enabled(environ: dict[str, str] | os._Environ[str] = os.environ) -> bool:
    """Whether the worker starts vLLM's engine core from the fork server (the default)."""
    return environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off")


class EnvSnapshotProcess(ForkServerProcess):
    """A fork-server child that runs with its parent's environment as of :meth:`start`."""

    _parent_env: dict[str, str]

    def start(self) -> None:
        self._parent_env = dict(os.environ)
        super().start()

    def run(self) -> None:
        env = getattr(self, "_parent_env", None)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        super().run()


class EngineContext(ForkServerContext):
    """The fork-server context whose processes carry the parent's environment."""

    Process = EnvSnapshotProcess


CONTEXT = EngineContext()


def begin(preload: Sequence[str] = PRELOAD) -> bool:
    """Start the fork server, importing ``preload`` in it; False where it could not start."""
    try:
        CONTEXT.set_forkserver_preload(list(preload))
        multiprocessing.forkserver.ensure_running()
    except (OSError, ValueError) as exc:
        log.warning("vLLM's engine core will be spawned: the fork server did not start: %s", exc)
        return False
    log.info("fork server for vLLM's engine core started, preloading %s", ", ".join(preload))
    return True


def running() -> bool:
    """Whether this process's fork server is up."""
    server: Any = getattr(multiprocessing.forkserver, "_forkserver", None)
    return server is not None and getattr(server, "_forkserver_pid", None) is not None


def install() -> bool:
    """Make vLLM start its engine core from the fork server (once vLLM is imported and the
    server runs); False, logged, where this vLLM takes its start method elsewhere."""
    if not running():
        return False
    try:
        utils = importlib.import_module(ENGINE_UTILS)
    except ImportError:
        utils = None
    if utils is None or not callable(getattr(utils, "get_mp_context", None)):
        log.info("vLLM's engine core is started as this vLLM starts it (no %s)", ENGINE_UTILS)
        return False
    utils.get_mp_context = lambda: CONTEXT  # type: ignore[attr-defined]
    log.info("vLLM's engine core starts from the fork server")
    return True
