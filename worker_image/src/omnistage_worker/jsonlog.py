"""Log output for the worker and the operator: text lines, or one JSON object per line.

A JSON line has ``time`` (UTC, RFC 3339 with milliseconds), ``level``, ``logger`` and
``message``, the process's own fields (a worker's ``stage`` and ``pod``), every field a log
call passes with ``extra=`` (``task_id``, ``epoch``, ``group``, ...), kopf's object
reference as ``object`` where kopf logs about an object, and ``exception`` with the traceback.
Standard library only: both images have it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TextIO

__all__ = ["LOG_FORMATS", "JsonFormatter", "configure_logging"]

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# Attributes every LogRecord has; anything else on a record came from ``extra=``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message",
    "asctime",
    "taskName",
}
# kopf's own extras: the object reference (kept, as "object") and its internal flags.
_KOPF_SKIPPED = frozenset({"k8s_skip", "settings"})


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``fields`` go into every object."""

    def __init__(self, fields: Mapping[str, Any] | None = None) -> None:
        super().__init__()
        self.fields = dict(fields or {})

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **self.fields,
        }
        for key, value in vars(record).items():
            if key in _STANDARD or key in _KOPF_SKIPPED or key.startswith("_"):
                continue
            out["object" if key == "k8s_ref" else key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def configure_logging(
    stream: TextIO, level: str, form: str, fields: Mapping[str, Any] | None = None
) -> None:
    """The root logger writes ``form`` (text or json) lines at ``level`` to ``stream``;
    handlers set before are replaced. Python warnings become log records too (logger
    ``py.warnings``), so a JSON log holds nothing but JSON lines."""
    if form not in LOG_FORMATS:
        raise ValueError(f"log format {form!r} (one of {', '.join(LOG_FORMATS)})")
    handler = logging.StreamHandler(stream)
    formatter = JsonFormatter(fields) if form == "json" else logging.Formatter(TEXT_FORMAT)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.captureWarnings(True)
