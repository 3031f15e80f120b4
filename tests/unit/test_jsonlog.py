"""JSON log lines (omnistage_worker.jsonlog) and the operator's log flags."""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator

import pytest

from omnistage_operator.k8s.settings import SettingsError, parse_settings
from omnistage_worker.jsonlog import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    logging.captureWarnings(False)


def test_json_lines_carry_fields_extras_and_tracebacks(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging(out, "info", "json", {"stage": "writer"})
    log = logging.getLogger("omnistage_worker.control.transition_acks")
    log.debug("not shown")
    log.info("ack %s", "t-1", extra={"task_id": "t-1", "epoch": 3})
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    # kopf's object loggers pass the object's reference as k8s_ref, plus internal flags.
    logging.getLogger("kopf.objects").warning(
        "handler", extra={"k8s_ref": {"name": "a"}, "k8s_skip": False}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.warn("version not supported", UserWarning, stacklevel=1)
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 4
    ack, failed, kopf, warned = lines
    assert warned["logger"] == "py.warnings" and "version not supported" in warned["message"]
    assert ack["level"] == "INFO" and ack["logger"] == "omnistage_worker.control.transition_acks"
    assert (ack["message"], ack["task_id"], ack["epoch"], ack["stage"]) == (
        "ack t-1",
        "t-1",
        3,
        "writer",
    )
    assert ack["time"].endswith("+00:00") and "T" in ack["time"]
    assert "RuntimeError: boom" in failed["exception"] and failed["level"] == "ERROR"
    assert kopf["object"] == {"name": "a"} and "k8s_skip" not in kopf


def test_text_is_the_default_and_bad_formats_are_refused(restore_root: None) -> None:
    out = io.StringIO()
    configure_logging(out, "INFO", "text")
    logging.getLogger("x").info("hello")
    assert out.getvalue().rstrip().endswith("INFO x: hello")
    with pytest.raises(ValueError, match="log format"):
        configure_logging(out, "INFO", "xml")


def test_operator_log_flags() -> None:
    settings = parse_settings(["--log-format", "json", "--log-level", "debug"], {})
    assert (settings.log_format, settings.log_level) == ("json", "DEBUG")
    env = parse_settings([], {"OMNISTAGE_LOG_FORMAT": "json"})
    assert (env.log_format, env.log_level) == ("json", "INFO")
    with pytest.raises(SettingsError, match="--log-level"):
        parse_settings(["--log-level", "loud"], {})
    with pytest.raises(SystemExit):
        parse_settings(["--log-format", "xml"], {})
