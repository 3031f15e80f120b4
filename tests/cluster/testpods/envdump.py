"""Print one JSON line with the environment, argv and the text of every file argument, then
sleep until SIGTERM (``--sleep``) or exit with ``--exit CODE``."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str]) -> int:
    code = 0
    sleep = False
    files = {}
    for arg in argv:
        if arg == "--sleep":
            sleep = True
        elif arg.startswith("--exit="):
            code = int(arg.split("=", 1)[1])
        elif Path(arg).is_file():
            files[arg] = Path(arg).read_text()
    print(
        "ENVDUMP "
        + json.dumps({"env": dict(os.environ), "argv": argv, "files": files, "cwd": os.getcwd()}),
        flush=True,
    )
    if sleep:
        done = threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: done.set())
        done.wait()
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
