"""The vLLM controller's call sequence and the NVML probe's engine pids (no vLLM, no GPU here).

The physics of a vLLM stage are tested against the stand-in engine in test_vllm_standin.py;
here a recording ``vllm.LLM`` shows which vLLM calls the worker makes, in which order.
"""

from __future__ import annotations

import os
from typing import Any

import pytest

from omnistage_worker.memory import NvmlProbe
from omnistage_worker.runners.vllm import VllmController


class RecordingLLM:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def sleep(self, level: int) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method: str) -> None:
        self.calls.append(("collective_rpc", method))


def test_level1_cycle() -> None:
    llm = RecordingLLM()
    ctl = VllmController(llm, weights_bytes=10)
    assert ctl.sleep(1).noop is False and ctl.level == 1
    assert ctl.host_bytes() == 10
    assert ctl.sleep(1).noop
    ctl.wake()
    assert llm.calls == [("sleep", 1), ("wake_up", None)]  # no reload for level 1
    assert ctl.level == 0 and ctl.wake().noop


def test_level2_wake_reloads_weights() -> None:
    llm = RecordingLLM()
    ctl = VllmController(llm, weights_bytes=10)
    ctl.sleep(2)
    ctl.wake()
    assert llm.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
    ]


def test_no_deepening_and_no_asleep_start() -> None:
    ctl = VllmController(RecordingLLM(), weights_bytes=10)
    ctl.sleep(1)
    with pytest.raises(RuntimeError, match="without waking"):
        ctl.sleep(2)
    with pytest.raises(RuntimeError, match="cannot start asleep"):
        ctl.start_asleep(1)


def test_engine_host_pids_are_adopted_when_nvml_lists_no_pid_of_the_tree() -> None:
    """In a container's PID namespace NVML lists host pids: the engine is the pids that
    appeared while it started (the worker's own pid never appears: it takes no context)."""
    probe = NvmlProbe.__new__(NvmlProbe)  # no driver here: NVML's process list is scripted
    probe.pid, probe.include_children, probe.own_context = os.getpid(), True, False
    probe.engine_pids, probe._warned, probe.index = set(), False, 0
    listed = {111: 5 << 20}  # another tenant of the device
    probe.processes = lambda: dict(listed)  # type: ignore[method-assign]
    before = probe.listed_pids()
    listed.update({900001: 10 << 20, 900002: 1 << 20})  # the engine core and a helper
    probe.own_device_users = lambda: {41, 42}  # type: ignore[method-assign]  # both of its tree
    probe.adopt_engine(before)
    assert probe.engine_pids == {900001, 900002}
    assert probe._process_used() == 11 << 20
    probe.touch()  # no CUDA context of its own (torch is not even needed)
