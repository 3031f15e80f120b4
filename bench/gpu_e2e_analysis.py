"""Pure figures of ``bench/gpu_e2e.py``: the NVML sampler's file, peaks, and ACK agreement.

The sampler writes one line per reading, ``S <unix time> <device free> <device used>
<pid>:<bytes> ...``, and once per process it sees ``P <pid> <cmdline>``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

MiB = 1024**2
GiB = 1024**3
# a sleep ACK's used-after agrees with the sampler within max(2 % of the larger, 256 MiB)
AGREE_FRACTION = 0.02
AGREE_FLOOR = 256 * MiB


@dataclass(frozen=True)
class Sample:
    """One sampler reading: wall time, the device's free and used bytes, bytes per pid."""

    t: float
    free: int
    used: int
    procs: Mapping[int, int] = field(default_factory=dict)


def parse_samples(lines: Iterable[str]) -> tuple[list[Sample], dict[int, str]]:
    """Samples in file order and each pid's command line (a torn last line is skipped)."""
    samples: list[Sample] = []
    cmdlines: dict[int, str] = {}
    for line in lines:
        parts = line.rstrip("\n").split(" ")
        try:
            if parts[0] == "P":
                cmdlines[int(parts[1])] = " ".join(parts[2:])
            elif parts[0] == "S":
                procs = {}
                for item in parts[4:]:
                    pid, nbytes = item.split(":")
                    procs[int(pid)] = int(nbytes)
                samples.append(Sample(float(parts[1]), int(parts[2]), int(parts[3]), procs))
        except (IndexError, ValueError):
            continue
    return samples, cmdlines


def read_samples(path: Path) -> tuple[list[Sample], dict[int, str]]:
    """:func:`parse_samples` of a file."""
    with path.open() as fh:
        return parse_samples(fh)


def sampler_periods(samples: Sequence[Sample]) -> list[float]:
    """Seconds between consecutive readings."""
    return [b.t - a.t for a, b in itertools.pairwise(samples)]


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 1] of a non-empty sequence."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def stage_bytes(sample: Sample, pids: Iterable[int]) -> int:
    """Bytes the processes ``pids`` held in one reading (absent: 0)."""
    return sum(sample.procs.get(pid, 0) for pid in pids)


def device_shares(samples: Sequence[Sample], pids: Iterable[int]) -> list[int]:
    """Per reading, what the processes ``pids`` held plus the device's memory charged to no
    process beyond what it was in the first reading: a piece handed from one worker to another
    is charged to no one between their handles, or while the taker keeps its descriptor open
    (``bench/results/handoff_charge_probe_h200.json``)."""
    pids = list(pids)
    unowned = uncharged(samples)
    first = unowned[0] if unowned else 0
    return [stage_bytes(s, pids) + u - first for s, u in zip(samples, unowned, strict=True)]


def uncharged(samples: Sequence[Sample]) -> list[int]:
    """Per reading, the device's used memory that NVML charges to no process."""
    return [s.used - sum(s.procs.values()) for s in samples]


def peak_together(samples: Sequence[Sample], groups: Sequence[Iterable[int]]) -> int:
    """The most the stages (each a set of pids) held together in any one reading."""
    sets = [frozenset(g) for g in groups]
    return max((sum(stage_bytes(s, g) for g in sets) for s in samples), default=0)


def parse_time(value: str | float | None) -> float | None:
    """Unix seconds of an RFC 3339 time (``...Z`` or with offset) or of a number."""
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return float(value)
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def reading_after(samples: Sequence[Sample], t: float) -> Sample | None:
    """The first reading taken at or after ``t``."""
    lo, hi = 0, len(samples)
    while lo < hi:
        mid = (lo + hi) // 2
        if samples[mid].t < t:
            lo = mid + 1
        else:
            hi = mid
    return samples[lo] if lo < len(samples) else None


def ack_agreement(
    samples: Sequence[Sample],
    pids: Mapping[str, Iterable[int]],
    sleeps: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]]:
    """Each sleep ACK's ``used_after_bytes`` against the sampler just after the ACK's ``time``.

    ``sleeps``: ``{"stage", "time" (the ACK's finish, RFC 3339), "used_after_bytes"}``.
    """
    out = []
    for ack in sleeps:
        t = parse_time(ack.get("time"))
        claimed = ack.get("used_after_bytes")
        reading = reading_after(samples, t) if t is not None else None
        if reading is None or claimed is None:
            out.append({"stage": ack.get("stage"), "within": False, "reason": "no reading"})
            continue
        seen = stage_bytes(reading, pids.get(str(ack["stage"]), ()))
        diff = abs(int(claimed) - seen)
        bound = max(AGREE_FRACTION * max(int(claimed), seen), AGREE_FLOOR)
        out.append({
            "stage": ack["stage"],
            "ack_used_after_bytes": int(claimed),
            "sampler_bytes": seen,
            "sampler_delay_ms": round((reading.t - t) * 1000, 2) if t is not None else None,
            "diff_bytes": diff,
            "within": diff <= bound,
        })  # fmt: skip
    return out
