"""cProfile over the operator's event-loop thread, switched by signals (bench/scale.py
``--cprofile-dir``; on ``PYTHONPATH`` only for that run).

Active only in an ``omnistage-operator`` process started with ``OMNISTAGE_CPROFILE_DIR`` set:
SIGUSR1 starts a profile of the main thread (the event loop: rounds, kopf, the API client,
gRPC aio), SIGUSR2 stops it and writes ``<dir>/<label>.prof`` (``label`` read from
``<dir>/label``). Other threads (the Lease's, the metrics server's) are not in it.
"""

import cProfile
import os
import signal
import sys
from pathlib import Path

_DIR = os.environ.get("OMNISTAGE_CPROFILE_DIR")
_PROFILE: list[cProfile.Profile] = []


def _start(signum: int, frame: object) -> None:
    if not _PROFILE:
        prof = cProfile.Profile()
        _PROFILE.append(prof)
        prof.enable()


def _stop(signum: int, frame: object) -> None:
    if not _PROFILE:
        return
    prof = _PROFILE.pop()
    prof.disable()
    folder = Path(str(_DIR))
    label_file = folder / "label"
    label = label_file.read_text().strip() if label_file.exists() else "window"
    prof.dump_stats(str(folder / f"{label}.prof"))


if _DIR and Path(sys.argv[0]).name == "omnistage-operator":
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
