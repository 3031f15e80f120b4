"""cProfile windows over the operator's event-loop thread for bench/scale.py
(``--cprofile-dir``): the hook in bench/cprofile_hook/sitecustomize.py, switched by signals.

py-spy over the saturated 2-core VM samples a runnable thread that is not running as busy (its
samples were 1.35-2.26x the operator's CPU, bench/results/README.md): cProfile counts only what
the loop's thread ran. Its own overhead inflates every call (more for many small calls), so its
figures compare functions within one window and the same window before and after a change,
not with the operator's CPU seconds.
"""

from __future__ import annotations

import os
import pstats
import signal
import time
from pathlib import Path
from typing import Any

__all__ = ["HOOK_DIR", "CProfileWindow", "enable"]

HOOK_DIR = Path(__file__).resolve().parent / "cprofile_hook"


def enable(folder: Path) -> None:
    """Operators started from now on load the hook and profile into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    os.environ["OMNISTAGE_CPROFILE_DIR"] = str(folder)
    path = os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONPATH"] = f"{HOOK_DIR}{os.pathsep}{path}" if path else str(HOOK_DIR)


class CProfileWindow:
    """One window's profile of process ``pid`` into ``<folder>/<label>.prof``."""

    def __init__(self, pid: int, folder: Path, label: str) -> None:
        self.pid, self.out = pid, folder / f"{label}.prof"
        (folder / "label").write_text(label)
        os.kill(pid, signal.SIGUSR1)

    def stop(self, within_s: float = 60.0) -> dict[str, Any]:
        """Stop it; the functions with the most cumulative and own time (seconds)."""
        os.kill(self.pid, signal.SIGUSR2)
        deadline, size = time.monotonic() + within_s, -1
        while time.monotonic() < deadline:
            time.sleep(0.5)
            now = self.out.stat().st_size if self.out.exists() else -1
            if now > 0 and now == size:
                return top(pstats.Stats(str(self.out)))
            size = now
        return {"error": f"no profile at {self.out}"}


def top(stats: pstats.Stats, n: int = 30) -> dict[str, Any]:
    """The ``n`` functions with the most cumulative and the most own time."""
    table: dict[tuple[str, int, str], tuple[int, int, float, float, Any]] = getattr(
        stats, "stats", {}
    )
    rows: list[tuple[str, int, float, float]] = [
        (f"{Path(file).name}:{line}:{name}", calls, own, cum)
        for (file, line, name), (_, calls, own, cum, _) in table.items()
    ]
    total = float(getattr(stats, "total_tt", 0.0))

    def pick(own: bool) -> list[list[Any]]:
        best = sorted(rows, key=lambda r: -(r[2] if own else r[3]))[:n]
        return [[f, c, round(o, 3), round(cu, 3)] for f, c, o, cu in best]

    return {"total_s": round(total, 3), "cumulative": pick(False), "own": pick(True)}
