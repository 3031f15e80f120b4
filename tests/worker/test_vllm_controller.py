"""The vLLM controller's call sequence and the NVML probe's engine pids (no vLLM, no GPU here).

The physics of a vLLM stage are tested against the stand-in engine in test_vllm_standin.py and
test_vllm_serving.py; here a recording async engine shows which calls of vLLM's ``AsyncLLM``
the worker makes, in which order, on the event loop, from the transition lane's thread.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import pytest

from omnistage_worker.memory import NvmlProbe
from omnistage_worker.runners.vllm_controller import VllmController
from omnistage_worker.runners.vllm_serve import LoopBridge


class RecordingEngine:
    """Records each call and that it ran on the event loop's thread."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.loop_thread = threading.get_ident()

    def _note(self, call: tuple[str, Any]) -> None:
        assert threading.get_ident() == self.loop_thread, "an engine call off the loop"
        self.calls.append(call)

    async def sleep(self, level: int) -> None:
        self._note(("sleep", level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        self._note(("wake_up", tags))

    async def collective_rpc(self, method: str) -> None:
        self._note(("collective_rpc", method))

    async def reset_prefix_cache(self) -> bool:
        self._note(("reset_prefix_cache", None))
        return True


async def controller() -> tuple[VllmController, RecordingEngine]:
    engine = RecordingEngine()
    return VllmController(engine, LoopBridge(), weights_bytes=10), engine


async def test_level1_cycle() -> None:
    ctl, engine = await controller()
    assert (await asyncio.to_thread(ctl.sleep, 1)).noop is False and ctl.level == 1
    assert ctl.host_bytes() == 10
    assert (await asyncio.to_thread(ctl.sleep, 1)).noop
    await asyncio.to_thread(ctl.wake)
    assert engine.calls == [("sleep", 1), ("wake_up", None)]  # no reload for level 1
    assert ctl.level == 0 and ctl.wake().noop


async def test_level2_wake_reloads_weights_and_resets_the_prefix_cache() -> None:
    ctl, engine = await controller()
    await asyncio.to_thread(ctl.sleep, 2)
    await asyncio.to_thread(ctl.wake)
    assert engine.calls == [
        ("sleep", 2),
        ("wake_up", ["weights"]),
        ("collective_rpc", "reload_weights"),
        ("wake_up", ["kv_cache"]),
        ("reset_prefix_cache", None),
    ]


async def test_no_deepening_and_no_asleep_start() -> None:
    ctl, _ = await controller()
    await asyncio.to_thread(ctl.sleep, 1)
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
