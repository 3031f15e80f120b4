"""localnode's side of the simulated worker hosts (:mod:`tests.scale.simhost`).

With ``--sim-hosts K`` localnode starts K host processes and gives node ``i``'s worker
containers (command ``omnistage-worker``) to host ``i % K`` instead of starting a process per
container; everything else about the pod (env, volumes, probes, status) is as usual. A
:class:`SimWorker` stands for the container's process: the host's pid, a return code and a
``wait``. ``<state>/simhosts.json`` lists each host's pid and nodes, so a test can stop a host
(SIGSTOP: its workers stop answering, as an unresponsive machine's would).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from tests.cluster.procs import die_with_parent

log = logging.getLogger("localnode.sim")

WORKER_EXECUTABLE = "omnistage-worker"
HOSTS_FILE = "simhosts.json"


def is_worker(argv: list[str]) -> bool:
    """Whether a container runs the omnistage worker (the simulated host can serve it)."""
    return bool(argv) and Path(argv[0]).name == WORKER_EXECUTABLE


class SimWorker:
    """A worker container served by a simulated host (in place of its process)."""

    def __init__(self, host: SimHostClient, key: str) -> None:
        self.host = host
        self.key = key
        self.pid = host.pid
        self.returncode: int | None = None
        self.message = ""
        self.started = asyncio.get_running_loop().create_future()
        self._exited = asyncio.Event()

    def exited(self, code: int, message: str) -> None:
        self.returncode = code
        self.message = message
        if not self.started.done():
            self.started.set_result(False)
        self._exited.set()

    async def wait(self) -> int:
        await self._exited.wait()
        assert self.returncode is not None
        return self.returncode

    async def stop(self, grace: float) -> None:
        """SIGTERM with ``grace`` seconds, then SIGKILL (grace 0: at once)."""
        if self.returncode is not None:
            return
        self.host.send({"op": "stop", "key": self.key, "grace": grace})
        try:
            await asyncio.wait_for(asyncio.shield(self.wait()), grace + 10)
        except TimeoutError:
            self.host.send({"op": "stop", "key": self.key, "grace": 0})
            await self.wait()


class SimHostClient:
    """One host process and its control connection."""

    def __init__(self, index: int, socket_path: Path, log_path: Path) -> None:
        self.index = index
        self.socket_path = socket_path
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None
        self.pid = 0
        self._writer: asyncio.StreamWriter | None = None
        self._workers: dict[str, SimWorker] = {}
        self._reader_task: asyncio.Task[None] | None = None

    async def start(self, within_s: float = 60.0) -> None:
        """Start the host process and connect to its control socket."""
        self.socket_path.unlink(missing_ok=True)
        argv = [sys.executable, "-m", "tests.scale.simhost", f"--socket={self.socket_path}"]
        with self.log_path.open("ab") as fh:
            self.proc = await asyncio.create_subprocess_exec(
                *die_with_parent(argv), stdout=fh, stderr=asyncio.subprocess.STDOUT
            )
        self.pid = self.proc.pid
        deadline = asyncio.get_running_loop().time() + within_s
        while True:
            try:
                reader, self._writer = await asyncio.open_unix_connection(str(self.socket_path))
                break
            except OSError as exc:
                if self.proc.returncode is not None:
                    raise RuntimeError(
                        f"simulated host {self.index} exited: see {self.log_path}"
                    ) from exc
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(0.1)
        self._reader_task = asyncio.create_task(self._read(reader))

    def send(self, message: dict[str, Any]) -> None:
        if self._writer is not None and not self._writer.is_closing():
            self._writer.write(json.dumps(message).encode() + b"\n")

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            msg = json.loads(line)
            worker = self._workers.get(msg["key"])
            if worker is None:
                continue
            if msg["event"] == "started" and not worker.started.done():
                worker.started.set_result(True)
            elif msg["event"] == "exited":
                self._workers.pop(msg["key"], None)
                worker.exited(int(msg["code"]), str(msg.get("message") or ""))
        log.warning("simulated host %d closed its connection", self.index)
        for worker in list(self._workers.values()):
            worker.exited(137, "the simulated host went away")
        self._workers.clear()

    async def launch(self, key: str, argv: list[str], env: dict[str, str]) -> SimWorker:
        """Start the worker of ``argv`` (its container args) with ``env`` on this host."""
        worker = SimWorker(self, key)
        self._workers[key] = worker
        self.send({"op": "start", "key": key, "argv": argv[1:], "env": env})
        return worker

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            with contextlib.suppress(Exception):
                await self._writer.wait_closed()
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(18)  # SIGCONT: a stopped host must see its end
            try:
                await asyncio.wait_for(self.proc.wait(), 15)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        if self._reader_task is not None:
            self._reader_task.cancel()


class SimHosts:
    """``count`` hosts; node index ``i`` is served by host ``i % count``."""

    def __init__(self, state_dir: Path, count: int) -> None:
        self.state_dir = state_dir
        self.hosts = [
            SimHostClient(i, state_dir / f"simhost-{i}.sock", state_dir / f"simhost-{i}.log")
            for i in range(count)
        ]

    async def start(self, node_indexes: dict[str, int]) -> None:
        await asyncio.gather(*(h.start() for h in self.hosts))
        count = len(self.hosts)
        table = {
            str(h.index): {
                "pid": h.pid,
                "log": str(h.log_path),
                "nodes": sorted(n for n, i in node_indexes.items() if i % count == h.index),
            }
            for h in self.hosts
        }
        tmp = self.state_dir / f".{HOSTS_FILE}.tmp"
        tmp.write_text(json.dumps(table, indent=1))
        os.replace(tmp, self.state_dir / HOSTS_FILE)
        log.info("%d simulated worker host(s) started", len(self.hosts))

    def host_for(self, node_index: int) -> SimHostClient:
        return self.hosts[node_index % len(self.hosts)]

    async def close(self) -> None:
        await asyncio.gather(*(h.close() for h in self.hosts), return_exceptions=True)
