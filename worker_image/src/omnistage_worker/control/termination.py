"""The termination message: a one-line reason a worker gives up, for the pod's status.

Kubernetes mounts a file at the container's ``terminationMessagePath`` (``/dev/termination-log``
by default) and copies what the process wrote there into
``status.containerStatuses[].state.terminated.message`` when the container ends, so
``kubectl describe pod`` (and the operator) show why a worker exited without reading its logs.

Where it goes: ``--termination-log PATH``, else ``$OMNISTAGE_TERMINATION_LOG``, else
``/dev/termination-log`` when that file exists and is writable (the kubelet creates it; outside
a pod nothing is written, so a worker run by hand, or by a test harness on a host, never
creates files under /dev). An empty path turns it off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

log = logging.getLogger(__name__)

FLAG: Final = "--termination-log"
ENV: Final = "OMNISTAGE_TERMINATION_LOG"
DEFAULT: Final = Path("/dev/termination-log")
# The kubelet keeps at most 4096 bytes of a termination message.
LIMIT: Final = 4096


def from_argv(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """The flag's value scanned from raw arguments (they may not parse), else the env's."""
    value: str | None = None
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(FLAG + "="):
            value = arg.partition("=")[2]
    return value if value is not None else env.get(ENV)


def resolve(value: str | None, default: Path = DEFAULT) -> Path | None:
    """Where to write (None: nowhere); ``value`` as given by the flag or the environment."""
    if value is not None:
        return Path(value) if value.strip() else None
    if default.is_file() and os.access(default, os.W_OK):
        return default
    return None


def one_line(reason: str) -> str:
    """``reason`` on one line, within the kubelet's limit."""
    text = " ".join(reason.split())
    encoded = text.encode()
    if len(encoded) <= LIMIT:
        return text
    return encoded[: LIMIT - 3].decode(errors="ignore") + "..."


def write(path: Path | None, reason: str) -> None:
    """Write ``reason`` (one line) to ``path``; never raises (the exit matters more)."""
    if path is None:
        return
    try:
        path.write_text(one_line(reason) + "\n" if reason else "", encoding="utf-8")
    except OSError as exc:
        log.warning("could not write the termination message to %s: %s", path, exc)
