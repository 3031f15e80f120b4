"""Where a worker's cold start spends its time: the load path in-process, sampled.

    python bench/coldstart_probe.py MODEL_DIR [cuda|cpu]

Runs the worker's own steps one after the other in this process (imports, CUDA context, the
runner's load, activation, the warm-up twice) while a sampler thread records every thread's
Python stack each 5 ms; prints each step's seconds and the functions found most often on the
stacks during it (share of the samples x the step's seconds; the sampler
needs the GIL, so long calls that hold it are under-sampled). A diagnostic, not a benchmark.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

INTERVAL = 0.005
SKIP = ("<frozen importlib", "coldstart_probe.py", "threading.py:", "thread.py:_worker")


class Sampler:
    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._me = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self._me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == self._me:
                    continue
                seen = set()
                f: FrameType | None = frame
                while f is not None:
                    code = f.f_code
                    key = (
                        f"{names.get(ident, '?')[:18]} {Path(code.co_filename).name}:{code.co_name}"
                    )
                    if key not in seen:
                        seen.add(key)
                        self.counts[key] += 1
                    f = f.f_back
            self.samples += 1
            time.sleep(INTERVAL)

    def take(self) -> tuple[collections.Counter[str], int]:
        counts, samples = self.counts, self.samples
        self.counts, self.samples = collections.Counter(), 0
        return counts, samples


def main() -> None:
    model_dir = Path(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    sampler = Sampler()
    steps: list[tuple[str, float]] = []

    def step(name: str, fn: object) -> object:
        started = time.perf_counter()
        out = fn()  # type: ignore[operator]
        seconds = time.perf_counter() - started
        counts, samples = sampler.take()
        steps.append((name, seconds))
        print(f"== {name}: {seconds:.3f}s ({samples} samples)", flush=True)
        shown = [(k, n) for k, n in counts.most_common() if not any(s in k for s in SKIP)]
        for key, n in shown[:40]:
            print(f"   {seconds * n / max(samples, 1):7.3f}s  {key}")
        return out

    step("import torch", lambda: __import__("torch"))
    step("import server", lambda: __import__("omnistage_worker.server"))
    from omnistage_worker.config import WorkerConfig, parse_device
    from omnistage_worker.runners import create_runner

    config = WorkerConfig(
        runner="ar",
        backend="transformers",
        model=model_dir,
        host="127.0.0.1",
        port=0,
        device=parse_device(device),
    )
    runner = step("create runner", lambda: create_runner(config))
    if device == "cuda":
        from omnistage_worker.memory import create_cuda_context

        step("cuda context", lambda: create_cuda_context(0))
    step(
        "import transformers",
        lambda: __import__("transformers").AutoModelForCausalLM,
    )
    step("runner.load", runner.load)  # type: ignore[attr-defined]
    controller = step("build controller", runner.build_controller)  # type: ignore[attr-defined]
    step("activate", controller.activate)  # type: ignore[attr-defined]
    step("warm-up", runner.warm_up)  # type: ignore[attr-defined]
    step("warm-up again", runner.warm_up)  # type: ignore[attr-defined]
    print("SUMMARY", {name: round(s, 3) for name, s in steps})
    runner.close()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
