"""One request's generated text: stop sequences and what may be streamed so far.

Pure logic over a ``decode`` function (token ids to text), so it is tested without a model.
Generation ends once the decoded text contains a stop sequence: the text is cut before it and
the tokens run up to the one that completed it. A streamed chunk never holds text that a stop
sequence could still take back (the tail that is a prefix of a stop waits), nor a trailing
replacement character (a multi-byte character not complete yet).

Each token decodes a window of the newest ids (at most :data:`WINDOW`, starting
:data:`CONTEXT` tokens before the text not decoded yet, so a leading space or a joined
character sees its neighbour), not all of them: a request's decoding costs the same per token
however long it runs (it ran on the batch's thread, once per row and token). Up to
:data:`WINDOW` tokens the window is the whole output; the final text is always decoded whole.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

Decode = Callable[[list[int]], str]

WINDOW = 16
"""Most ids decoded for one token ..."""
CONTEXT = 4
"""... of which this many before the text not taken yet (when the window moves on)."""


class TextOutput:
    """The text of one request's tokens so far; ``stopped`` once a stop sequence appeared."""

    def __init__(self, decode: Decode, stops: Sequence[str], streamed: bool) -> None:
        self._decode = decode
        self._stops = [s for s in stops if s]
        self._streamed = streamed
        self.ids: list[int] = []
        self.text = ""
        self.stopped = False
        self._sent = ""
        self._start = 0
        """Where the decoded window begins in ``ids``."""
        self._window_text = ""
        """The text of ``ids[_start:]`` as far as it has been taken into ``_decoded``."""
        self._decoded = ""
        """The text of the ids taken so far (a tail not complete yet waits)."""

    @property
    def needs_text(self) -> bool:
        """Whether each token must be decoded as it comes (stops or streaming)."""
        return bool(self._stops) or self._streamed

    def add(self, token_id: int) -> str:
        """Take one token; the text that may be streamed now (empty: nothing new yet)."""
        self.ids.append(token_id)
        if not self.needs_text:
            return ""
        text = self._decode_newest()
        cut = self._first_stop(text)
        if cut is not None:
            self.stopped = True
            self.text = text[:cut]
            return self._advance(self.text)
        self.text = text
        return self._advance(text[: len(text) - self._held_back(text)])

    def finish(self) -> str:
        """Generation ended: the final text, and the rest not streamed yet (returned)."""
        if not self.stopped:
            self.text = self._decode(self.ids)
        return self._advance(self.text, final=True)

    def _decode_newest(self) -> str:
        """The text of all ids so far, decoding the window of the newest ones only."""
        window = self._decode(self.ids[self._start :])
        if window.endswith("\ufffd"):
            return self._decoded + window[len(self._window_text) :]  # not complete yet
        self._decoded += window[len(self._window_text) :]
        self._window_text = window
        if len(self.ids) - self._start >= WINDOW:
            self._start = len(self.ids) - CONTEXT
            self._window_text = self._decode(self.ids[self._start :])
        return self._decoded

    def _first_stop(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self._stops) if i >= 0]
        return min(found) if found else None

    def _held_back(self, text: str) -> int:
        """How many trailing characters could still become (part of) a stop sequence."""
        held = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:size]):
                    held = size
                    break
        return held

    def _advance(self, text: str, final: bool = False) -> str:
        if not self._streamed:
            return ""
        if not final and text.endswith("\ufffd"):
            return ""
        if not text.startswith(self._sent):
            return ""  # the decoded text changed behind what was sent: nothing to add safely
        delta, self._sent = text[len(self._sent) :], text
        return delta
