"""Device memory handed from the outgoing worker to the incoming one in an overlapped hand-over,
instead of freed by one and created anew by the other (issue 23).

Why, measured on the H200: the driver cleans freed device memory in the background, and
host -> device copies run at half rate while it does, so an incoming wake that takes memory the
outgoing sleep has just freed trails it (``bench/results/handoff_probe*.json``: 16 GiB handed over
read 0.51-0.56 of the serial copy bound, freed 0.61-0.67, in the same runs). Handed over, a
piece is never freed, so never cleaned.

The channel is a Unix socket (``SOCK_SEQPACKET``) that the incoming worker listens on, named by
its caller, in a directory both workers reach (:data:`HANDOFF_DIR_ENV`). Each message is one
piece: its size (8 bytes, little-endian) and its physical memory as a file descriptor
(``cuMemExportToShareableHandle``). The outgoing worker sends a piece once its copy to the host
is done and before it unmaps and releases its own handle (after which NVML charges the piece to
no one, ``bench/results/handoff_charge_probe_h200.json``) and reports the release, so its
measured use never falls by a piece the incoming worker cannot find yet; anything it cannot
send (no listener yet, a full queue, a closed channel) it frees as before.

The promise is unchanged: the incoming worker takes a piece only once its claim limit admits it.
:meth:`Receiver.admitted` keeps the device's use no higher than a freeing hand-over's would be:
after each admitted claim it reads every piece sent so far (each sent before the release that
raised the limit was reported); a claim for a piece of a size it holds takes one of those, and
any other claim first closes every piece it holds (they are then freed, as the outgoing worker
would have freed them) before new memory is made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import socket
import struct
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger(__name__)

HANDOFF_DIR_ENV = "OMNISTAGE_HANDOFF_DIR"
"""A directory the workers sharing a device can all reach (a hostPath in a pod); unset, the
worker neither hands memory over nor takes it, and says so (``GetStatus.handoff``)."""

CHANNEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SOCKET_PATH_MAX = 107
"""``sun_path`` holds 108 bytes with its terminating NUL."""

HEADER = struct.Struct("<Q")


def handoff_dir() -> Path | None:
    """:data:`HANDOFF_DIR_ENV`'s directory, or None when unset."""
    value = os.environ.get(HANDOFF_DIR_ENV, "")
    return Path(value) if value else None


def handoff_refusal() -> str:
    """Why this worker cannot open every channel a caller may name (unset, or a directory too
    long for a socket of the longest name); empty when it can (``GetStatus.handoff``)."""
    directory = handoff_dir()
    if directory is None:
        return f"the worker has no hand-off directory ({HANDOFF_DIR_ENV} is unset)"
    longest = len(os.fsencode(directory)) + len("/.sock") + 64
    if longest > SOCKET_PATH_MAX:
        return (
            f"the hand-off directory {directory} leaves no room for a channel's socket "
            f"({longest} bytes with the longest name; a Unix socket takes {SOCKET_PATH_MAX})"
        )
    return ""


def channel_path(name: str) -> Path:
    """The socket of channel ``name``: LookupError when the worker has no hand-off directory,
    ValueError for a name that cannot be one."""
    why = handoff_refusal()
    if why:
        raise LookupError(why)
    if not CHANNEL_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a channel name (letters, digits, '.', '_', '-'; at most 64, "
            "starting with a letter or digit)"
        )
    directory = handoff_dir()
    assert directory is not None  # (handoff_refusal says so otherwise)
    return directory / f"{name}.sock"


class Sender:
    """The outgoing worker's end: connects on the first piece it can send, never blocks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._closed = ""
        self.sent_pieces = 0
        self.sent_bytes = 0
        self.unsent_pieces = 0

    def _connected(self) -> socket.socket | None:
        if self._sock is None and not self._closed:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                sock.connect(os.fspath(self.path))
            except OSError:  # no listener yet: try again with the next piece
                sock.close()
                return None
            sock.setblocking(False)
            self._sock = sock
        return self._sock

    def send(self, fd: int, nbytes: int) -> bool:
        """Hand the piece ``fd`` (``nbytes``) over; False when it was not (free it instead).
        The caller keeps ``fd`` and closes it either way."""
        with self._lock:
            sock = self._connected()
            if sock is not None:
                try:
                    socket.send_fds(sock, [HEADER.pack(nbytes)], [fd])
                except BlockingIOError:  # the incoming worker's queue is full
                    pass
                except OSError as exc:  # it went away: free the rest
                    self._closed = f"the channel closed: {exc}"
                    sock.close()
                    self._sock = None
                else:
                    self.sent_pieces += 1
                    self.sent_bytes += nbytes
                    return True
            self.unsent_pieces += 1
            return False

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            self._closed = self._closed or "closed"


def listening(path: Path) -> bool:
    """Someone listens at ``path`` (a wake of the same channel still running: a repeated
    WakeUp of its task id must not open a second one that pieces could go to and wait in)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        probe.connect(os.fspath(path))
    except OSError:
        return False
    finally:
        probe.close()
    return True


class Receiver:
    """The incoming worker's end: listens at ``path`` (a stale socket there is replaced)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._listener.bind(os.fspath(path))
            self._listener.listen(4)
            self._listener.setblocking(False)
        except OSError:
            self._listener.close()
            raise
        self._peers: list[socket.socket] = []
        self._held: deque[tuple[int, int]] = deque()  # (size, fd) received, not yet taken
        self._lock = threading.Lock()
        self.taken_pieces = 0
        self.taken_bytes = 0
        self.dropped_pieces = 0

    def _read(self) -> None:
        """Every piece sent so far into ``_held``."""
        while True:
            try:
                peer, _ = self._listener.accept()
            except BlockingIOError:
                break
            peer.setblocking(False)
            self._peers.append(peer)
        for peer in list(self._peers):
            while True:
                try:
                    data, fds, _, _ = socket.recv_fds(peer, HEADER.size, 1, socket.MSG_CMSG_CLOEXEC)
                except BlockingIOError:
                    break
                if not data and not fds:  # the sender closed its end
                    peer.close()
                    self._peers.remove(peer)
                    break
                if len(data) == HEADER.size and len(fds) == 1:
                    self._held.append((HEADER.unpack(data)[0], fds[0]))
                else:  # not a piece: nothing of it is kept
                    for fd in fds:
                        os.close(fd)

    def _drop_held(self) -> None:
        while self._held:
            _, fd = self._held.popleft()
            os.close(fd)
            self.dropped_pieces += 1

    def admitted(self, nbytes: int) -> int | None:
        """After a claim of ``nbytes`` is admitted: the descriptor of a piece of that size
        handed over (the caller imports and closes it), or None after every held piece has been
        closed (``nbytes`` 0: a claim that takes no piece)."""
        with self._lock:
            self._read()
            if nbytes:
                for i, (size, fd) in enumerate(self._held):
                    if size == nbytes:
                        del self._held[i]
                        self.taken_pieces += 1
                        self.taken_bytes += size
                        return fd
            self._drop_held()
            return None

    def close(self) -> None:
        """Stop listening; every piece held or still queued is closed (freed)."""
        with self._lock:
            self._read()
            self._drop_held()
            for peer in self._peers:
                peer.close()
            self._peers.clear()
            self._listener.close()
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()


class _SenderSlot:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sender: Sender | None = None


_SLOT = _SenderSlot()


@contextlib.contextmanager
def sending(sender: Sender | None) -> Iterator[None]:
    """The sleep inside this block hands its pieces to ``sender`` (nothing with None)."""
    if sender is None:
        yield
        return
    with _SLOT.lock:
        if _SLOT.sender is not None:
            raise RuntimeError("a hand-off sender is already installed")
        _SLOT.sender = sender
    try:
        yield
    finally:
        with _SLOT.lock:
            _SLOT.sender = None
        sender.close()
        log.info(
            "hand-off %s: %d pieces (%d bytes) handed over, %d freed instead",
            sender.path.stem,
            sender.sent_pieces,
            sender.sent_bytes,
            sender.unsent_pieces,
        )


def current_sender() -> Sender | None:
    """The running sleep's sender; None when it frees its pieces."""
    return _SLOT.sender
