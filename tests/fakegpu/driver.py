"""The simulated GPU's host side: process identity and liveness in the host's PID namespace.

A real GPU driver lives in the kernel: it charges an allocation to the process's host pid and
frees it when that process dies, whatever PID namespace the process runs in, so NVML lists
host pids even inside a container. A simulated GPU is a directory shared by processes
(:mod:`.device`); in a container a process sees its own PID namespace (its pid is not the
host's, and other containers' processes are invisible to it), so it can neither key its record
by host pid nor tell whether another container's process still runs.

:class:`DriverServer` runs on the host (the real node's harness starts one for its devices)
and answers on ``<device dir>/driver.sock``, one JSON line per request:

- ``{"op": "self"}`` -> ``{"pid": P, "create_time": T}``: the caller's host pid, from the
  socket's peer credentials (the kernel translates the pid into the server's namespace, as
  it does for the driver);
- ``{"op": "alive", "procs": [[pid, create_time], ...]}`` -> ``{"alive": [bool, ...]}``:
  liveness of host pids, judged on the host.

Without the socket (a process on the host, localnode) everything is judged locally, as before.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import socketserver
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import psutil

SOCKET_NAME = "driver.sock"
_TIMEOUT_S = 10.0


def alive(pid: int, create_time: float) -> bool:
    """Whether process ``pid`` is the one that was created at ``create_time`` and still runs."""
    try:
        proc = psutil.Process(pid)
        return abs(proc.create_time() - create_time) < 1.0 and proc.status() != "zombie"
    except psutil.Error:
        return False


def answer(request: Any, peer_pid: int) -> dict[str, Any]:
    """The reply to one request from the process whose host pid is ``peer_pid``."""
    op = request.get("op") if isinstance(request, dict) else None
    if op == "self":
        return {"pid": peer_pid, "create_time": psutil.Process(peer_pid).create_time()}
    if op == "alive":
        return {"alive": [alive(int(pid), float(ct)) for pid, ct in request.get("procs", [])]}
    return {"error": f"unknown request {request!r}"}


class _Handler(socketserver.StreamRequestHandler):
    def handle(self) -> None:
        creds = self.connection.getsockopt(
            socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")
        )
        peer_pid = struct.unpack("3i", creds)[0]
        for line in self.rfile:
            try:
                reply = answer(json.loads(line), peer_pid)
            except (ValueError, psutil.Error) as exc:
                reply = {"error": str(exc)}
            self.wfile.write(json.dumps(reply).encode() + b"\n")
            self.wfile.flush()


class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


class DriverServer:
    """Serve ``driver.sock`` in each device directory from threads of this (host) process."""

    def __init__(self, directories: Iterable[Path]) -> None:
        self.directories = [Path(d) for d in directories]
        self._servers: list[_Server] = []

    def __enter__(self) -> DriverServer:
        for directory in self.directories:
            path = directory / SOCKET_NAME
            path.unlink(missing_ok=True)
            server = _Server(str(path), _Handler)
            os.chmod(path, 0o666)  # container users connect too
            threading.Thread(target=server.serve_forever, daemon=True).start()
            self._servers.append(server)
        return self

    def __exit__(self, *exc: object) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()
        for directory in self.directories:
            with contextlib.suppress(OSError):
                (directory / SOCKET_NAME).unlink()


class DriverClient:
    """A process's connection to its device's host side (one socket, kept open)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._sock_pid = 0
        self._file: Any = None

    def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            if self._sock is None or self._sock_pid != os.getpid():
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self._sock.settimeout(_TIMEOUT_S)
                self._sock.connect(str(self.path))
                self._file = self._sock.makefile("rwb")
                self._sock_pid = os.getpid()  # a forked child connects afresh (its own pid)
            self._file.write(json.dumps(request).encode() + b"\n")
            self._file.flush()
            reply: dict[str, Any] = json.loads(self._file.readline())
        if "error" in reply:
            raise RuntimeError(f"{self.path}: {reply['error']}")
        return reply

    def host_identity(self) -> tuple[int, float]:
        """This process's host pid and create time."""
        reply = self._ask({"op": "self"})
        return int(reply["pid"]), float(reply["create_time"])

    def alive(self, procs: list[tuple[int, float]]) -> list[bool]:
        """Liveness of host pids (with their create times), judged on the host."""
        if not procs:
            return []
        reply = self._ask({"op": "alive", "procs": [list(p) for p in procs]})
        return [bool(a) for a in reply["alive"]]
