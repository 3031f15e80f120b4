"""The GPU end-to-end bench's figures from a sampler file (bench/gpu_e2e_analysis.py)."""

from __future__ import annotations

from bench.gpu_e2e_analysis import (
    MiB,
    ack_agreement,
    parse_samples,
    peak_together,
    percentile,
    reading_after,
    sampler_periods,
)

FILE = """\
P 10 python3 -m omnistage_worker --model /w/models/llm --device cuda
P 20 python3 -m omnistage_worker --model /w/models/sd --device cuda
S 100.000 5000 7000 10:16000 20:600
S 100.010 5000 7000 10:16000 20:600
P 30 python3 ballast
S 100.020 4000 8000 10:600 20:600 30:100
S 100.030 3000 9000 10:600 20:13000 30:100
S 100.04"""


def test_parse_skips_a_torn_last_line_and_reads_cmdlines() -> None:
    samples, cmds = parse_samples(FILE.splitlines())
    assert len(samples) == 4
    assert samples[2].procs == {10: 600, 20: 600, 30: 100}
    assert cmds[20].endswith("--model /w/models/sd --device cuda")
    assert [round(p, 3) for p in sampler_periods(samples)] == [0.01, 0.01, 0.01]


def test_peak_together_sums_only_the_stages_within_one_reading() -> None:
    samples, _ = parse_samples(FILE.splitlines())
    # per reading: 16600, 16600, 1200, 13600; the ballast (30) never counts
    assert peak_together(samples, [{10}, {20}]) == 16600
    assert peak_together([], [{10}]) == 0


def test_reading_after_is_the_first_at_or_after() -> None:
    samples, _ = parse_samples(FILE.splitlines())
    found = reading_after(samples, 100.015)
    assert found is not None and found.t == 100.02
    assert reading_after(samples, 100.5) is None


def test_ack_agreement_uses_max_of_two_percent_and_256_mib() -> None:
    samples, _ = parse_samples(
        [
            "S 1700000000.000 0 0 10:17179869184 20:629145600",
            "S 1700000000.010 0 0 10:629145600 20:629145600",
        ]
    )
    pids = {"llm": {10}, "sd": {20}}
    when = "2023-11-14T22:13:20.005Z"  # 1700000000.005: the second reading is just after
    ok = ack_agreement(samples, pids, [{"stage": "llm", "time": when,
                                        "used_after_bytes": 629145600 + 200 * MiB}])  # fmt: skip
    assert ok[0]["within"] and ok[0]["sampler_bytes"] == 629145600
    assert ok[0]["sampler_delay_ms"] == 5.0
    bad = ack_agreement(samples, pids, [{"stage": "llm", "time": when,
                                         "used_after_bytes": 629145600 + 300 * MiB}])  # fmt: skip
    assert not bad[0]["within"]
    none = ack_agreement(samples, pids, [{"stage": "llm", "time": None, "used_after_bytes": 1}])
    assert none[0]["within"] is False


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([5.0], 0.95) == 5.0
