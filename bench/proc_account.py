"""Where a server's CPU goes under load: CPU time per process and per thread, and py-spy.

:func:`snapshot` reads user and system time of a process and of its descendants (vLLM's
engine core is a child of its API server, and of a stage's worker), per thread, from
``/proc`` (Linux; what psutil reads, without needing it in the environment); :func:`account`
turns two snapshots into seconds over the interval, threads grouped by name (gRPC's, uvloop's
and vLLM's threads are named). :class:`Profile` runs ``py-spy record`` (non-blocking: the
process is never paused) on one process while a load runs, and :func:`top_frames` reads its
collapsed stacks into the functions that held the CPU, per thread.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

Json = dict[str, Any]
TICK = os.sysconf("SC_CLK_TCK")


def _stat(path: Path) -> tuple[str, int, float, float] | None:
    """(name, parent pid, user s, system s) of one ``/proc/.../stat``; None when gone."""
    try:
        text = path.read_text()
    except OSError:
        return None
    name = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()  # from field 3 (state) on
    return name, int(fields[1]), int(fields[11]) / TICK, int(fields[12]) / TICK


def descendants(root: int) -> list[int]:
    """``root`` and every process below it."""
    parents: dict[int, list[int]] = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (st := _stat(entry / "stat")) is not None:
            parents[st[1]].append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(parents.get(pid, []))
    return found


def _cmd(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    return " ".join(p.decode(errors="replace") for p in raw.split(b"\0") if p)[:160]


def snapshot(root: int, tree: bool = True) -> Json:
    """CPU times of ``root`` (and, with ``tree``, its descendants), per process and thread."""
    procs: Json = {}
    for pid in descendants(root) if tree else [root]:
        st = _stat(Path(f"/proc/{pid}/stat"))
        if st is None:
            continue
        threads = {}
        for task in Path(f"/proc/{pid}/task").glob("*"):
            if (tst := _stat(task / "stat")) is not None:
                threads[task.name] = (tst[0], tst[2], tst[3])
        procs[str(pid)] = {"name": st[0], "cmd": _cmd(pid), "user": st[2], "system": st[3],
                           "threads": threads}  # fmt: skip
    return {"at": time.monotonic(), "procs": procs}


def account(before: Json, after: Json, top: int = 8) -> Json:
    """Seconds of CPU each process (and its busiest thread groups) spent between two
    snapshots, with ``cores``: CPU seconds per second of the interval."""
    wall = after["at"] - before["at"]
    out: list[Json] = []
    for pid, p in after["procs"].items():
        b = before["procs"].get(pid, {"user": 0.0, "system": 0.0, "threads": {}})
        user, system = p["user"] - b["user"], p["system"] - b["system"]
        groups: dict[str, float] = collections.defaultdict(float)
        for tid, (name, tu, ts) in p["threads"].items():
            _, bu, bs = b["threads"].get(tid, (name, 0.0, 0.0))
            groups[name] += (tu - bu) + (ts - bs)
        busiest = sorted(groups.items(), key=lambda kv: -kv[1])[:top]
        out.append({
            "pid": int(pid), "name": p["name"], "cmd": p["cmd"],
            "user_s": round(user, 2), "system_s": round(system, 2),
            "cpu_s": round(user + system, 2), "cores": round((user + system) / wall, 3),
            "threads": {n: round(s, 2) for n, s in busiest if s > 0},
        })  # fmt: skip
    out.sort(key=lambda p: -p["cpu_s"])
    return {"seconds": round(wall, 3), "processes": out}


class Profile:
    """``py-spy record`` of ``pid`` (raw collapsed stacks, per thread) until :meth:`stop`."""

    def __init__(self, py_spy: str, pid: int, out: Path, rate: int = 100) -> None:
        self.out = out
        cmd = [py_spy, "record", "--nonblocking", "--threads", "--rate", str(rate),
               "--format", "raw", "-o", str(out), "-p", str(pid)]  # fmt: skip
        self.log = out.with_suffix(".log")
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def stop(self) -> Json:
        """Stop sampling (py-spy writes its file on SIGINT); the busiest frames."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        if not self.out.exists():
            return {"error": self.log.read_text(errors="replace")[-600:]}
        return top_frames(self.out.read_text())


def top_frames(collapsed: str, top: int = 25) -> Json:
    """Per thread, the samples and the functions most often on top of the stack (self) and
    anywhere in it (total), from py-spy's collapsed ``thread;frame;...;frame count`` lines."""
    threads: dict[str, int] = collections.Counter()
    own: dict[str, int] = collections.Counter()
    total: dict[str, int] = collections.Counter()
    for line in collapsed.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        frames = stack.split(";")
        thread = frames[0].split(" (")[0] if frames[0].startswith(("thread", "process")) else ""
        threads[frames[0]] += n
        calls = frames[1:] if thread else frames
        if calls:
            own[calls[-1]] += n
        for frame in set(calls):
            total[frame] += n
    samples = sum(threads.values())
    return {
        "samples": samples,
        "threads": dict(collections.Counter(threads).most_common(top)),
        "self": dict(collections.Counter(own).most_common(top)),
        "total": dict(collections.Counter(total).most_common(top)),
    }
