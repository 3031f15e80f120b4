"""Inside a worker that ``bench/serving_cpu.py`` runs: what its event loop and its threads do.

``python bench/serving_probe.py STATS_PATH WORKER_ARGS...`` runs ``omnistage_worker``'s own
``main`` with three meters and writes their running totals to ``STATS_PATH`` (JSON) at each
``SIGUSR1`` (:func:`read_stats` sends it at the edges of the bench's windows; nothing runs in
between, so the meters cost the worker nothing else):

- the event loop: seconds spent outside its selector (busy), its wake-ups (selector returns),
  and the callbacks other threads handed it (``call_soon_threadsafe``);
- every thread's CPU seconds (``/proc/self/task``), summed per thread-name prefix (the decode
  batcher, the event loop, the request lane, gRPC...);
- the decode batcher's counters (steps, rows summed over steps, steps with joins, seconds
  inside steps).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

TICK = os.sysconf("SC_CLK_TCK")


class LoopMeter:
    """Running totals of one event loop."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.idle = 0.0
        self.selecting: float | None = None
        """When the select under way began (a total read meanwhile counts it as idle)."""
        self.wakeups = 0
        self.threadsafe_calls = 0

    def instrument(self, loop: asyncio.AbstractEventLoop) -> None:
        selector: Any = getattr(loop, "_selector")  # noqa: B009 (the selector loop's own)
        select = selector.select
        handover = loop.call_soon_threadsafe

        def timed_select(timeout: float | None = None) -> Any:
            self.selecting = began = time.monotonic()
            try:
                return select(timeout)
            finally:
                self.selecting = None
                self.idle += time.monotonic() - began
                self.wakeups += 1

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            self.threadsafe_calls += 1
            return handover(callback, *args, **kwargs)

        selector.select = timed_select
        loop.call_soon_threadsafe = counted  # type: ignore[method-assign,assignment]

    def totals(self) -> dict[str, float]:
        now = time.monotonic()
        selecting = self.selecting
        idle = self.idle + (now - selecting if selecting is not None else 0.0)
        return {
            "loop_busy_s": now - self.started - idle,
            "loop_wakeups": self.wakeups,
            "loop_threadsafe_calls": self.threadsafe_calls,
        }


class _Policy(asyncio.DefaultEventLoopPolicy):
    def __init__(self, meter: LoopMeter) -> None:
        super().__init__()
        self._meter = meter

    def new_event_loop(self) -> asyncio.AbstractEventLoop:
        loop = super().new_event_loop()
        self._meter.instrument(loop)
        return loop


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads, summed per name (a numbered name's number
    dropped: ``omnistage-generate-3`` counts as ``omnistage-generate``; unnamed Python threads
    as ``other``, threads Python did not start, such as gRPC's, as ``native``)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, float] = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            parts = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # the thread ended
        seconds = (int(parts[11]) + int(parts[12])) / TICK  # utime, stime
        name = names.get(int(task.name), "native").rstrip("0123456789").rstrip("-_")
        if name.startswith("Thread") or not name:
            name = "other"
        out[name] = out.get(name, 0.0) + seconds
    return out


def main() -> int:
    stats_path = Path(sys.argv[1])
    argv = sys.argv[2:]
    from omnistage_worker import cli
    from omnistage_worker.runners import decode_batch

    meter = LoopMeter()
    asyncio.set_event_loop_policy(_Policy(meter))
    batchers: list[Any] = []
    init = decode_batch.DecodeBatcher.__init__

    def registered(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        batchers.append(self)

    decode_batch.DecodeBatcher.__init__ = registered  # type: ignore[method-assign]

    def write(*_: Any) -> None:
        stats: dict[str, Any] = {"t": time.monotonic(), **meter.totals()}
        stats["threads_cpu_s"] = thread_cpu()
        if batchers:
            b = batchers[-1]
            stats["batcher"] = {
                "steps": b.steps,
                "row_steps": b.row_steps,
                "join_steps": b.join_steps,
                "step_seconds": b.step_seconds,
            }
        temporary = stats_path.with_suffix(".tmp")
        temporary.write_text(json.dumps(stats))
        temporary.replace(stats_path)

    signal.signal(signal.SIGUSR1, write)
    return cli.main(argv)


def read_stats(pid: int, stats_path: Path, within: float = 30.0) -> dict[str, Any]:
    """Ask the worker ``pid`` for its totals now; them, once written."""
    before = stats_path.stat().st_mtime_ns if stats_path.exists() else 0
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + within
    while not stats_path.exists() or stats_path.stat().st_mtime_ns == before:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no totals from the worker {pid} in {within} s")
        time.sleep(0.01)
    data: dict[str, Any] = json.loads(stats_path.read_text())
    return data


if __name__ == "__main__":
    sys.exit(main())
