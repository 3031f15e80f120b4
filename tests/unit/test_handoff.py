"""The hand-off channel between two workers (``engine/handoff.py``), over real Unix sockets with
real file descriptors passed between them.

A piece here is the write end of a pipe: like a device allocation's exported descriptor, what
it refers to lives while any descriptor of it is open, in either process or in flight, and the
read end tells when the last one has closed (end of file), which is when the driver would free
the memory. The driver's own export and import are run on the GPU by ``bench/overlap.py
--handoff``.
"""

from __future__ import annotations

import os
import select
import shutil
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage_worker.engine import handoff
from omnistage_worker.engine.claims import ClaimGate
from omnistage_worker.engine.handoff import HANDOFF_DIR_ENV, Receiver, Sender, channel_path


class Piece:
    """A pipe: ``fd`` (the piece's descriptor) and whether every reference to it is closed."""

    def __init__(self) -> None:
        self.read_end, self.fd = os.pipe()

    def freed(self) -> bool:
        ready, _, _ = select.select([self.read_end], [], [], 0)
        return bool(ready) and os.read(self.read_end, 1) == b""

    def same_as(self, fd: int) -> bool:
        """``fd`` refers to this piece: what is written to it comes out of the read end."""
        os.write(fd, b"x")
        return os.read(self.read_end, 1) == b"x"


@pytest.fixture
def pieces() -> Iterator[list[Piece]]:
    made: list[Piece] = []
    yield made
    for piece in made:
        os.close(piece.read_end)


def send(sender: Sender, pieces: list[Piece], size: int) -> tuple[Piece, bool]:
    """A new piece sent; the sender's descriptor closed, as the worker closes it after."""
    piece = Piece()
    pieces.append(piece)
    sent = sender.send(piece.fd, size)
    os.close(piece.fd)
    return piece, sent


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A directory short enough for a socket of any channel name (pytest's are too long)."""
    path = Path(tempfile.mkdtemp(prefix="ho", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def channel(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(HANDOFF_DIR_ENV, str(short_dir))
    return channel_path("wake-1")


def test_a_piece_sent_is_the_one_taken_and_lives_until_its_taker_closes_it(
    channel: Path, pieces: list[Piece]
) -> None:
    receiver = Receiver(channel)
    sender = Sender(channel)
    piece, sent = send(sender, pieces, 512)
    assert sent and not piece.freed(), "in flight: the socket holds a reference"
    fd = receiver.admitted(512)
    assert fd is not None and piece.same_as(fd)
    assert not piece.freed()
    os.close(fd)
    assert piece.freed()
    assert (receiver.taken_pieces, receiver.taken_bytes, receiver.dropped_pieces) == (1, 512, 0)
    receiver.close()
    sender.close()


def test_a_claim_that_takes_no_piece_frees_every_piece_held_first(
    channel: Path, pieces: list[Piece]
) -> None:
    """What keeps the device's use no higher than a freeing hand-over's: before new memory is
    made, no handed-over piece is left waiting."""
    receiver = Receiver(channel)
    sender = Sender(channel)
    small, _ = send(sender, pieces, 256)
    big, _ = send(sender, pieces, 512)
    assert receiver.admitted(1024) is None  # no piece of that size: both freed
    assert small.freed() and big.freed()
    again, _ = send(sender, pieces, 512)
    assert receiver.admitted(0) is None and again.freed()  # a claim not of a piece
    assert (receiver.taken_pieces, receiver.dropped_pieces) == (0, 3)
    receiver.close()
    sender.close()


def test_the_gate_hands_a_piece_over_only_once_its_claim_is_admitted(
    channel: Path, pieces: list[Piece]
) -> None:
    receiver = Receiver(channel)
    sender = Sender(channel)
    gate = ClaimGate(limit=100, held=100, handed=receiver)
    got: list[int | None] = []
    waiting = threading.Thread(target=lambda: got.append(gate.claim(512, piece=True)))
    waiting.start()
    piece, _ = send(sender, pieces, 512)  # sent before the release that raises the limit
    waiting.join(0.2)
    assert waiting.is_alive() and not got, "the limit does not admit it yet"
    gate.raise_limit(612)
    waiting.join(5)
    assert got and got[0] is not None and piece.same_as(got[0])
    os.close(got[0])
    receiver.close()
    sender.close()


def test_a_sender_with_no_listener_frees_its_pieces_and_connects_once_there_is_one(
    channel: Path, pieces: list[Piece]
) -> None:
    sender = Sender(channel)
    early, sent = send(sender, pieces, 512)
    assert not sent and early.freed()
    receiver = Receiver(channel)
    late, sent = send(sender, pieces, 512)
    assert sent and not late.freed()
    receiver.close()  # what it still held or had queued is freed
    assert late.freed()
    after, sent = send(sender, pieces, 512)
    assert not sent and after.freed()
    assert (sender.sent_pieces, sender.unsent_pieces) == (1, 2)
    sender.close()
    assert not channel.exists()


def test_a_full_channel_never_blocks_the_sleep(channel: Path, pieces: list[Piece]) -> None:
    """The incoming worker reads only as its claims are admitted; the sender's queue fills and
    it frees the pieces that do not fit instead of waiting."""
    receiver = Receiver(channel)
    sender = Sender(channel)
    results = []
    for _ in range(4096):
        piece, sent = send(sender, pieces, 512)
        results.append(sent)
        if not sent:
            assert piece.freed()
            break
        os.close(pieces.pop().read_end)
    assert results[0] and not results[-1], "the queue filled, and the send did not block"
    receiver.close()
    sender.close()


def test_channel_names_and_directories(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HANDOFF_DIR_ENV, raising=False)
    with pytest.raises(LookupError, match="OMNISTAGE_HANDOFF_DIR is unset"):
        channel_path("ok")
    monkeypatch.setenv(HANDOFF_DIR_ENV, str(short_dir))
    assert channel_path("a.b_c-1") == short_dir / "a.b_c-1.sock"
    for bad in ("", "../x", "a/b", ".hidden", "x" * 65):
        with pytest.raises(ValueError, match="not a channel name"):
            channel_path(bad)
    monkeypatch.setenv(HANDOFF_DIR_ENV, "/" + "d" * 37)  # "/<37>/<64>.sock": 108 bytes
    with pytest.raises(LookupError, match="leaves no room for a channel's socket"):
        channel_path("x")
    monkeypatch.setenv(HANDOFF_DIR_ENV, "/" + "d" * 36)
    assert len(str(channel_path("x" * 64))) == 107


def test_one_sender_at_a_time(channel: Path) -> None:
    with handoff.sending(Sender(channel)):
        assert handoff.current_sender() is not None
        with (
            pytest.raises(RuntimeError, match="already installed"),
            handoff.sending(Sender(channel)),
        ):
            pass
    assert handoff.current_sender() is None


def test_a_live_channel_is_not_opened_twice_and_a_stale_one_is_replaced(
    channel: Path, pieces: list[Piece]
) -> None:
    """A repeated WakeUp of a running wake must not take the channel from it (pieces sent to a
    listener no wake reads would wait there while the wake made memory of its own)."""
    assert not handoff.listening(channel)
    first = Receiver(channel)
    assert handoff.listening(channel)
    sender = Sender(channel)
    piece, sent = send(sender, pieces, 512)
    assert sent
    fd = first.admitted(512)  # the probe's connection is read and let go, the piece is there
    assert fd is not None and piece.same_as(fd)
    os.close(fd)
    first.close()
    assert not handoff.listening(channel)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    stale.bind(os.fspath(channel))  # bound, never listening: what a killed worker leaves
    stale.close()
    assert channel.exists() and not handoff.listening(channel)
    Receiver(channel).close()
    sender.close()
