"""The README lines for ``bench/coldstart.py`` (a worker's cold start); bench/report.py calls it."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

GiB = 1024**3
GOAL_S = 6.0


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["first_token_s"])
    return ordered[len(ordered) // 2]


def first_forward_lines(path: Path) -> list[str]:
    """``bench/first_forward.py``'s two runs (alone, beside the host pinning), when committed."""
    if not path.exists():
        return []
    runs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    alone = next((r for r in runs if not r["pin_gib"]), None)
    pinned = next((r for r in runs if r["pin_gib"]), None)
    if alone is None or pinned is None:
        return []
    return [
        "",
        f"Where the first token's time goes, `bench/first_forward.py` (same machine and day): "
        f"a fresh process's first prefill and decode step took "
        f"{alone['first_two_tokens_s']:.2f} s alone and {pinned['first_two_tokens_s']:.2f} s "
        f"while the engine page-locked its {pinned['pin_gib']:g} GiB host copy in the "
        f"background (as it does right after activation; the pinning took "
        f"{pinned['pin_s']:.2f} s, one registration): the first forward waited for the "
        "pinning. The engine now page-locks it in 64 MiB chunks, each started only while no "
        "request or warm-up runs (`engine/pinning.py`); the rows above are measured with it.",
    ]


def coldstart_section(
    data: dict[str, Any],
    no_bytecode: dict[str, Any] | None,
    first_forward: Path,
    earlier: dict[str, Any] | None = None,
) -> list[str]:
    """Spawn to first token, warm and cold page cache, with the phases and limits."""
    m, lim = data["machine"], data["limits"]
    warm = [r["first_token_s"] for r in data["warm"]]
    median = statistics.median(warm)
    run = _median_run(data["warm"])
    phases = run["phases_s"]
    nbytes = lim["weight_bytes"]
    lines = [
        "",
        f"Cold start of the real worker, `bench/coldstart.py` on {m.get('gpu', '?')} (driver "
        f"{m.get('driver', '?')}, {m['date'][:10]}): a {nbytes / GiB:.1f} GiB Llama-shaped "
        "causal LM, `python -m omnistage_worker` with the operator's flags, timed from the "
        "spawn; bytecode cached, as in the worker image (pip compiles it at install; this "
        "host's Python ships without it).",
        "",
        "| figure | value |",
        "|---|---|",
        f"| spawn to first token, page cache warm (runs) | {median:.1f} s "
        f"({', '.join(f'{w:.1f}' for w in warm)}); goal {GOAL_S:g} s: "
        f"{'yes' if median <= GOAL_S else '**no**'} |",
    ]
    if "baseline" in data:
        base = data["baseline"]
        first = base["first_token_s"]
        lines.append(
            f"| the previous worker code, same run | {first:.1f} s (Active at "
            f"{base['serving_s']:.1f} s, its first request {first - base['serving_s']:.1f} s) |"
        )
    if all("warm_up_s" in r for r in data["warm"]):
        ups = ", ".join(f"{r['warm_up_s']:.1f}" for r in data["warm"])
        base_up = data.get("baseline", {}).get("warm_up_s")
        lines.append(
            f"| warm-up before Active (2 tokens, runs) | {ups} s"
            + (f"; the previous worker code, same run, {base_up:.1f} s" if base_up else "")
            + " |"
        )
    lines += [
        f"| phases of the median run (s from spawn) | imports {phases['imports done']:.1f}, "
        f"gRPC up {phases['gRPC serving']:.1f}, transformers imported and model built "
        f"{phases['model built']:.1f}, weights on the device {phases['weights on device']:.1f}, "
        f"warm-up done and Active {phases['active']:.1f} (warm-up {run['warm_up_s']:.1f}), "
        f"first request after Active {run['first_token_s'] - run['serving_s']:.2f} |",
        f"| limits in the same run | page-cache read {lim['read_gbps']:.0f} GB/s, pinned H2D "
        f"{lim['h2d_gbps']:.0f} GB/s (the weights: {nbytes / lim['read_gbps'] / 1e9:.2f} / "
        f"{nbytes / lim['h2d_gbps'] / 1e9:.2f} s); a fresh process importing what the worker "
        f"imports {lim['import_model_s']:.1f} s (torch alone {lim['import_torch_s']:.1f} s) |",
    ]
    for source, note in ((data, ""), (earlier, "earlier code")):
        cold = source.get("cold_evicted") if source is not None else None
        if source is None or cold is None:
            continue
        disk = source["disk_read_gbps"]
        when = f" ({source['machine']['date'][:10]}, {note})" if note else ""
        lines.append(
            f"| spawn to first token, weights evicted from the page cache{when} | "
            f"{cold['first_token_s']:.1f} s (disk {disk:.2f} GB/s: the weights alone "
            f"{nbytes / disk / 1e9:.1f} s) |"
        )
        break
    if no_bytecode is not None:
        nb = [r["first_token_s"] for r in no_bytecode["warm"]]
        lines.append(
            f"| without bytecode ({no_bytecode['machine']['date'][:10]}, earlier code) | "
            f"{statistics.median(nb):.1f} s, the previous code "
            f"{no_bytecode['baseline']['first_token_s']:.1f} s; importing what the worker "
            f"imports {no_bytecode['limits']['import_model_s']:.1f} s |"
        )
    return lines + first_forward_lines(first_forward)
