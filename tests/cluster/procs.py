"""Start and stop background processes in their own process groups; small polling helpers."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run so that the kernel SIGKILLs it when its parent dies (Linux ``setpriv``).

    setpriv sets PR_SET_PDEATHSIG and execs the program (same pid). Without setpriv the
    command is returned unchanged (a fork-time ``preexec_fn`` is unsafe with threads).
    """
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv else list(argv)


def wait_tied(pid: int, timeout: float = 10.0) -> None:
    """Return once ``pid`` (started through ``die_with_parent``) runs its own program.

    setpriv arms PR_SET_PDEATHSIG only when it runs, after ``Popen`` has returned: a parent
    that dies in between leaves the child running, re-parented. Once the child has exec'd
    past setpriv the signal is armed (or the child is gone, also fine).
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        return
    real = os.path.realpath(setpriv)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            exe = os.readlink(f"/proc/{pid}/exe")
        except OSError:
            return  # exited, or a zombie: nothing to tie
        if exe != real:
            return
        time.sleep(0.005)
    raise TimeoutError(f"process {pid} still in setpriv after {timeout:.0f} s")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(
    what: str,
    check: Callable[[], bool],
    timeout: float,
    interval: float = 0.1,
    alive: Callable[[], str | None] | None = None,
) -> None:
    """Poll ``check`` until true; raise TimeoutError naming ``what`` after ``timeout`` seconds.

    ``alive`` returns an error message when what is awaited can no longer happen (a process
    died), which ends the wait at once.
    """
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(Exception):
            if check():
                return
        if alive is not None and (msg := alive()):
            raise RuntimeError(f"while waiting for {what}: {msg}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout:.0f}s")
        time.sleep(interval)


def terminate(proc: subprocess.Popen[bytes], grace: float = 20.0) -> None:
    """SIGTERM ``proc`` (a single process, e.g. the operator), SIGKILL it after ``grace`` s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def tail_log(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file ("" when it cannot be read)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class ManagedProcess:
    """A child in its own process group, output to ``log``; ``stop`` ends the whole group.

    The child is also SIGKILLed by the kernel if this process dies without cleaning up (a
    test run killed by a timeout), so nothing is left running on a shared machine.
    """

    def __init__(
        self, name: str, argv: Sequence[str], log: Path, env: dict[str, str] | None = None
    ):
        self.name = name
        self.argv = list(argv)
        self.log = log
        self._fh = log.open("ab")
        self.proc = subprocess.Popen(
            die_with_parent(self.argv),
            stdout=self._fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
        )
        wait_tied(self.proc.pid)

    def died(self) -> str | None:
        """A message if the process has exited, with the tail of its log."""
        rc = self.proc.poll()
        if rc is None:
            return None
        return f"{self.name} exited with {rc}; last log lines:\n{self.tail()}"

    def tail(self, lines: int = 25) -> str:
        """The last lines of the log."""
        return tail_log(self.log, lines)

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the process group (ignored if it is already gone)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM the group, wait ``grace`` seconds, then SIGKILL it."""
        if self.proc.poll() is None:
            self.signal_group(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.signal_group(signal.SIGKILL)
                self.proc.wait(5)
        # children that outlived the leader still belong to the group
        self.signal_group(signal.SIGKILL)
        self._fh.close()
