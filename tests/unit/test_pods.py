"""Pure readings of pods, claims and ResourceSlices (``omnistage_operator.decisions.pods``)."""

from __future__ import annotations

from typing import Any

from omnistage_operator.decisions.pods import CrashBackoff, claim_device_uuids, exit_message


def _pod(state: dict[str, Any], phase: str = "Failed", key: str = "state") -> dict[str, Any]:
    return {"status": {"phase": phase, "containerStatuses": [{"name": "worker", key: state}]}}


def test_exit_message_is_the_workers_own_reason() -> None:
    term = {"exitCode": 2, "reason": "Error", "message": "model directory /m does not exist\n"}
    assert exit_message(_pod({"terminated": term})) == (
        "exit code 2 (Error): model directory /m does not exist"
    )
    assert exit_message(_pod({"terminated": term}, "Running", "lastState")) is not None
    assert exit_message(_pod({"terminated": {"exitCode": 137, "reason": "OOMKilled"}})) == (
        "exit code 137 (OOMKilled)"
    )
    assert exit_message(_pod({"running": {}}, "Running")) is None


def test_backoff_doubles_from_10s_to_5min_and_counts_each_pod_once() -> None:
    b = CrashBackoff()
    delays = []
    for i in range(8):
        b = b.exited(f"uid-{i}", "boom", 1000.0)
        delays.append(b.delay_s())
        assert b.exited(f"uid-{i}", "boom", 2000.0) is b  # the same pod again: not counted
    assert delays == [10, 20, 40, 80, 160, 300, 300, 300]
    assert b.waiting(1000.0) == 300 and b.waiting(1400.0) == 0
    assert b.message == "boom" and b.restarts == 8


def test_claim_uuids_come_from_the_slices_of_the_allocated_devices() -> None:
    claim = {
        "status": {
            "allocation": {
                "devices": {
                    "results": [
                        {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-1"},
                        {"driver": "gpu.nvidia.com", "pool": "n1", "device": "gpu-0"},
                    ]
                }
            }
        }
    }
    slices = [
        {
            "spec": {
                "driver": "gpu.nvidia.com",
                "pool": {"name": "n1"},
                "devices": [
                    {"name": f"gpu-{i}", "attributes": {"uuid": {"string": f"GPU-{i}"}}}
                    for i in range(3)
                ],
            }
        },
        {  # another node's slice names the same devices: not ours
            "spec": {
                "driver": "gpu.nvidia.com",
                "pool": {"name": "n2"},
                "devices": [{"name": "gpu-0", "attributes": {"uuid": {"string": "GPU-X"}}}],
            }
        },
    ]
    assert claim_device_uuids(claim, slices) == ("GPU-0", "GPU-1")
    assert claim_device_uuids({"status": {}}, slices) is None  # not allocated yet
    assert claim_device_uuids(claim, slices[1:]) is None  # a device without a slice


def test_a_log_tail_is_cut_to_its_last_lines() -> None:
    logs = "Loading 0%\rLoading 100%\nwarning: x\n\nERROR model directory /m does not exist\n"
    msg = exit_message(_pod({"terminated": {"exitCode": 2, "reason": "Error", "message": logs}}))
    assert msg == (
        "exit code 2 (Error): Loading 100% | warning: x | ERROR model directory /m does not exist"
    )


def test_a_changed_pod_spec_ends_the_back_off_and_starts_the_count_again() -> None:
    backoff = (
        CrashBackoff().exited("a", "no KV cache", 0.0, "s1").exited("b", "no KV cache", 1.0, "s1")
    )
    assert (backoff.restarts, backoff.waiting(1.0), backoff.spec_hash) == (2, 20.0, "s1")
    assert backoff.current("s1") and not backoff.current("s2")
    fixed = backoff.exited("c", "other", 2.0, "s2")  # an exit under the new spec: its first
    assert (fixed.restarts, fixed.waiting(2.0), fixed.spec_hash) == (1, 10.0, "s2")
    assert CrashBackoff().current("s2")  # no count yet: nothing to reset
