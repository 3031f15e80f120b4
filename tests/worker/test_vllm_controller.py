"""The vLLM controller's call sequence (vLLM itself cannot run here: no vLLM, no GPU).

A recording stand-in for ``vllm.LLM`` is the only way to see which vLLM calls the worker makes.
"""

from __future__ import annotations

from typing import Any

import pytest

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
    assert llm.calls == [("sleep", 1), ("wake_up", None)]
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
