"""bench/proc_account.py: CPU seconds of a process tree from /proc, and py-spy's stacks read."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.proc_account import account, snapshot, top_frames

BUSY = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"


def test_a_busy_child_is_counted_in_its_parents_tree() -> None:
    """A child that spins 0.6 s of CPU shows that much under the parent's tree, not under
    the parent alone, and an idle one (sleeping) none."""
    me = os.getpid()
    before, alone_before = snapshot(me), snapshot(me, tree=False)
    busy = subprocess.Popen([sys.executable, "-c", BUSY + "time.sleep(30)"])
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 60
        while True:  # until the child has spun its 0.6 s (its CPU time stops growing)
            after = snapshot(me)
            child = next((p for p in account(before, after)["processes"] if p["pid"] == busy.pid),
                         None)  # fmt: skip
            if child is not None and child["cpu_s"] >= 0.55:
                break
            assert time.monotonic() < deadline, "the busy child never showed its CPU time"
            time.sleep(0.1)
        alone = account(alone_before, snapshot(me, tree=False))
    finally:
        busy.kill()
        idle.kill()
        busy.wait()
        idle.wait()
    by_pid = {p["pid"]: p for p in account(before, after)["processes"]}
    assert by_pid[busy.pid]["cpu_s"] < 1.5
    assert by_pid[busy.pid]["threads"]  # its main thread, by name
    assert by_pid[idle.pid]["cpu_s"] < 0.3
    assert [p["pid"] for p in alone["processes"]] == [me]


def test_top_frames_of_collapsed_stacks_per_thread() -> None:
    collapsed = (
        "thread (11): MainThread;main (a.py:1);loop (a.py:5);send (h11.py:9) 30\n"
        "thread (11): MainThread;main (a.py:1);loop (a.py:5);dump (json.py:2) 10\n"
        "thread (12): poller;poll (grpc.py:3) 5\n"
    )
    top = top_frames(collapsed)
    assert top["samples"] == 45
    assert top["threads"] == {"thread (11): MainThread": 40, "thread (12): poller": 5}
    assert top["self"]["send (h11.py:9)"] == 30 and top["self"]["poll (grpc.py:3)"] == 5
    assert top["total"]["loop (a.py:5)"] == 40
    assert "thread (11): MainThread" not in top["total"]
