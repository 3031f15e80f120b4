"""The fork server vLLM's engine core starts from (runners/vllm_forkserver.py): real processes."""

from __future__ import annotations

import multiprocessing.forkserver
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from omnistage_worker.runners import vllm_forkserver
from tests.unit import forkserver_probe

PROBE = "OMNISTAGE_FORKSERVER_PROBE"


def _stop_server() -> None:
    server: Any = multiprocessing.forkserver._forkserver
    server._stop()


@pytest.fixture
def server() -> Iterator[None]:
    _stop_server()
    assert vllm_forkserver.begin([forkserver_probe.__name__])
    yield
    _stop_server()
    os.environ.pop(PROBE, None)


def _child_report(process_class: type[Any]) -> dict[str, Any]:
    queue = vllm_forkserver.CONTEXT.Queue()
    proc = process_class(target=forkserver_probe.report, args=(queue,))
    proc.start()
    try:
        report: dict[str, Any] = queue.get(timeout=60)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    return report


def test_a_child_starts_with_the_preloaded_modules_and_the_parents_environment_now(
    server: None,
) -> None:
    assert vllm_forkserver.running()
    os.environ[PROBE] = "set after the server started"  # as vLLM sets its variables
    report = _child_report(vllm_forkserver.CONTEXT.Process)
    assert report["imported_by"] not in (report["pid"], os.getpid())  # imported in the server
    assert report["env"] == "set after the server started"


def test_a_plain_fork_server_child_would_miss_what_the_parent_set_later(server: None) -> None:
    os.environ[PROBE] = "set after the server started"
    report = _child_report(multiprocessing.get_context("forkserver").Process)
    assert report["env"] is None  # why EnvSnapshotProcess carries the environment


def test_install_points_vllms_engine_start_at_the_fork_server(
    server: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    utils = types.ModuleType(vllm_forkserver.ENGINE_UTILS)
    utils.get_mp_context = lambda: "spawn"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_forkserver.ENGINE_UTILS, utils)
    assert vllm_forkserver.install()
    assert utils.get_mp_context() is vllm_forkserver.CONTEXT


def test_install_leaves_vllm_alone_without_a_server_or_its_module(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _stop_server()
    utils = types.ModuleType(vllm_forkserver.ENGINE_UTILS)
    utils.get_mp_context = lambda: "spawn"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, vllm_forkserver.ENGINE_UTILS, utils)
    assert not vllm_forkserver.install()  # no server
    assert utils.get_mp_context() == "spawn"
    assert vllm_forkserver.begin([forkserver_probe.__name__])
    try:
        monkeypatch.setitem(sys.modules, vllm_forkserver.ENGINE_UTILS, None)
        assert not vllm_forkserver.install()  # no such module: vLLM's own start
    finally:
        _stop_server()


@pytest.mark.parametrize(("value", "on"), [(None, True), ("1", True), ("0", False), ("off", False)])
def test_the_fork_server_is_on_unless_turned_off(value: str | None, on: bool) -> None:
    env = {} if value is None else {vllm_forkserver.ENV: value}
    assert vllm_forkserver.enabled(env) is on
