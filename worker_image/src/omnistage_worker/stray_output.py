"""Stray output as JSON log lines: text that libraries write to ``sys.stdout``/``sys.stderr``
themselves (transformers' and diffusers' own log handlers, vLLM's, ``print``) becomes one JSON
object per line (logger ``stdout``/``stderr``), so a JSON log holds nothing but JSON lines.

Only Python-level writes are caught; a C library writing to file descriptor 2 is not. Standard
library only.
"""

from __future__ import annotations

import atexit
import logging
import sys
from collections.abc import Iterable
from typing import Any, TextIO

from omnistage_worker.jsonlog import JsonFormatter

__all__ = ["JsonLineStream", "capture_stray_output", "real_stream"]


class JsonLineStream:
    """A text stream that writes each complete line it receives as one JSON log object."""

    def __init__(self, target: TextIO, name: str, level: int, formatter: JsonFormatter) -> None:
        self.target = target
        self.name = name
        self.level = level  # logging.INFO, logging.WARNING, ...
        self.formatter = formatter
        self._partial = ""

    def write(self, text: str) -> int:
        lines = (self._partial + text).split("\n")
        self._partial = lines.pop()
        for line in lines:
            self._emit(line)
        return len(text)

    def writelines(self, lines: Iterable[str]) -> None:
        for line in lines:
            self.write(line)

    def flush(self) -> None:
        self.target.flush()

    def close_line(self) -> None:
        """Write a pending partial line (at exit)."""
        if self._partial:
            self._emit(self._partial)
            self._partial = ""
        self.target.flush()

    def _emit(self, line: str) -> None:
        line = line.rstrip("\r")
        if not line.strip():
            return
        record = logging.LogRecord(self.name, self.level, "", 0, line, (), None)
        self.target.write(self.formatter.format(record) + "\n")
        self.target.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.target.fileno()

    @property
    def encoding(self) -> str:
        return getattr(self.target, "encoding", "utf-8") or "utf-8"

    def __getattr__(self, attr: str) -> Any:  # errors, buffer, ...: the target's
        return getattr(self.target, attr)


def real_stream(stream: TextIO) -> TextIO:
    """The stream under a :class:`JsonLineStream` (the stream itself otherwise)."""
    return stream.target if isinstance(stream, JsonLineStream) else stream


def capture_stray_output(formatter: JsonFormatter) -> tuple[JsonLineStream, JsonLineStream]:
    """Replace ``sys.stdout`` and ``sys.stderr`` by JSON line streams over the real ones; a log
    handler made before keeps the real stream. Returns the two wrappers."""
    out = JsonLineStream(real_stream(sys.stdout), "stdout", logging.INFO, formatter)
    err = JsonLineStream(real_stream(sys.stderr), "stderr", logging.WARNING, formatter)
    sys.stdout, sys.stderr = out, err
    atexit.register(out.close_line)
    atexit.register(err.close_line)
    return out, err
