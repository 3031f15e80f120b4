"""``bench/overlap.py``'s figures: the sampler's room check counts the device's memory charged to
no process (a handed-over piece between two processes' handles, or kept with its descriptor
open), and the workers' hand-off log lines summed."""

from __future__ import annotations

from pathlib import Path

from bench.gpu_e2e_analysis import Sample
from bench.overlap import handoff_counts
from bench.overlap_relay import room_check

A, B, BALLAST = 11, 12, 13


def test_memory_charged_to_no_process_counts_against_the_room() -> None:
    # The device's used memory = what the processes are charged + 5 the driver keeps, then +4
    # charged to no one (pieces in flight): the stages' own figures stay within the room of 20.
    samples = [
        Sample(0.0, 0, 10 + 30 + 5, {A: 10, B: 0, BALLAST: 30}),
        Sample(0.1, 0, 18 + 30 + 5 + 4, {A: 10, B: 8, BALLAST: 30}),
        Sample(0.2, 0, 19 + 30 + 5, {A: 1, B: 18, BALLAST: 30}),
    ]
    check = room_check(samples, (A, B), room=20)
    assert check["within_room"] and check["samples_over_room"] == 0
    assert check["peak_together_bytes"] == 19
    assert check["device_peak_bytes"] == 22 and check["device_samples_over_room"] == 1
    assert check["device_uncharged_first_bytes"] == 5


def test_handoff_counts_sum_both_workers_logs(tmp_path: Path) -> None:
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(
        "INFO omnistage_worker.engine.handoff: hand-off w1: 3 pieces (768 bytes) handed over, "
        "1 freed instead\nunrelated line\n"
    )
    b.write_text(
        "INFO omnistage_worker.control.overlap: hand-off w1: 2 pieces (512 bytes) taken over, "
        "1 freed unused\n"
    )
    assert handoff_counts([a, b, tmp_path / "absent.log"]) == {
        "sent_pieces": 3,
        "sent_bytes": 768,
        "unsent_pieces": 1,
        "taken_pieces": 2,
        "taken_bytes": 512,
        "dropped_pieces": 1,
    }
