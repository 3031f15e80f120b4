"""bench/scale.py's figures: percentiles and the plot of overhead against stages (an SVG
written by hand: matplotlib is not a dependency)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def percentiles(values: list[float]) -> dict[str, float]:
    """p50/p95/p99/max (linear interpolation), rounded to milliseconds; {} when empty."""
    if not values:
        return {}
    ordered = sorted(values)

    def pct(q: float) -> float:
        k = (len(ordered) - 1) * q
        lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
        return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)

    return {
        "p50": round(pct(0.5), 3),
        "p95": round(pct(0.95), 3),
        "p99": round(pct(0.99), 3),
        "max": round(ordered[-1], 3),
        "n": len(ordered),
    }


COLORS = {1: "#1f77b4", 2: "#d62728"}
W, H, PAD = 640, 400, 60


def write_svg(runs: list[dict[str, Any]], path: Path) -> None:
    """Hand-over storm overhead p50 and p99 (seconds) against stages, one line per replicas."""
    points: dict[tuple[int, str], list[tuple[int, float]]] = {}
    for run in runs:
        storm = run.get("handover") or {}
        for q in ("p50", "p99"):
            if q in storm.get("overhead_s", {}):
                points.setdefault((run["replicas"], q), []).append(
                    (run["stages"], storm["overhead_s"][q])
                )
    if not points:
        return
    xs = sorted({x for pts in points.values() for x, _ in pts})
    ymax = max(y for pts in points.values() for _, y in pts) * 1.15 or 1.0

    def sx(x: int) -> float:
        i = xs.index(x)
        return PAD + (W - 2 * PAD) * (i / max(len(xs) - 1, 1))

    def sy(y: float) -> float:
        return H - PAD - (H - 2 * PAD) * y / ymax

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
        'font-family="sans-serif" font-size="12">',
        f'<rect width="{W}" height="{H}" fill="white"/>',
        f'<text x="{W / 2}" y="20" text-anchor="middle">hand-over storm: operator overhead per '
        "hand-over (s) vs stages</text>",
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - PAD}" y2="{H - PAD}" stroke="black"/>',
        f'<line x1="{PAD}" y1="{PAD}" x2="{PAD}" y2="{H - PAD}" stroke="black"/>',
    ]
    for x in xs:
        out.append(f'<text x="{sx(x)}" y="{H - PAD + 18}" text-anchor="middle">{x}</text>')
    for i in range(5):
        y = ymax * i / 4
        out.append(f'<text x="{PAD - 6}" y="{sy(y) + 4}" text-anchor="end">{y:.2f}</text>')
    for n, ((replicas, q), pts) in enumerate(sorted(points.items())):
        pts.sort()
        dash = "" if q == "p50" else ' stroke-dasharray="6,4"'
        line = " ".join(f"{sx(x)},{sy(y)}" for x, y in pts)
        color = COLORS.get(replicas, "black")
        out.append(f'<polyline points="{line}" fill="none" stroke="{color}"{dash}/>')
        for x, y in pts:
            out.append(f'<circle cx="{sx(x)}" cy="{sy(y)}" r="3" fill="{color}"/>')
        out.append(
            f'<text x="{W - PAD - 150}" y="{PAD + 16 * n}" fill="{color}">'
            f"{q}, {replicas} replica(s)</text>"
        )
    out.append(f'<text x="{W / 2}" y="{H - 15}" text-anchor="middle">stages</text>')
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")


STORM_NAMES = ("ondemand", "handover", "handover_again", "leader_kill", "unresponsive")


def markdown(result: dict[str, Any]) -> str:
    """The README's table of a scale.json: one row per size, replicas and storm."""
    rows = [
        "| stages (nodes) | replicas | storm | groups | converge s | overhead p50 / p95 / p99 s "
        "| API requests / round | objects / round (max group) | API requests/s | operator CPU s "
        "| RSS MiB | watch lag p99 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in result["runs"]:
        for name in STORM_NAMES:
            s = run.get(name)
            if not s:
                continue
            o = s.get("overhead_s") or {}
            lag = (s.get("watch_lag_s") or {}).get("p99", "-")
            frozen = f" ({s['frozen_groups']} frozen)" if s.get("frozen_groups") else ""
            rows.append(
                f"| {run['stages']} ({run['nodes']}) | {run['replicas']} | {name}{frozen} "
                f"| {s['groups']} | {s['converge_s']} | {o.get('p50')} / {o.get('p95')} / "
                f"{o.get('p99')} | {s['api_requests_per_round']} | {s['api_objects_per_round']} "
                f"({s['api_objects_per_round_max_group']}) | {s['api_requests_per_s']} "
                f"| {s['operator_cpu_s']} | {s['operator_rss_mib']} | {lag} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    import json
    import sys

    print(markdown(json.loads(Path(sys.argv[1]).read_text())))
