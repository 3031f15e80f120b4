"""The limits a worker's cold start is held against, measured on the machine that runs it, and
the page-cache helpers ``bench/coldstart.py`` uses (eviction, residency).

Run as a child of ``bench/coldstart.py`` (``python bench/coldstart_limits.py MODEL_DIR``), so the
parent holds no CUDA context. It prints one JSON object:

- ``read_gbps``: the weight files read from the page cache by 8 threads into reused buffers
  (no copy anywhere): what reading the bytes costs at best;
- ``h2d_gbps``: page-locked host to device copies (the engine's own registered host memory);
- ``engine_stream_gbps``: the worker's own path, files to the device through pinned staging
  buffers (:class:`omnistage_worker.engine.reload.FileLoader`);
- ``python_s``, ``import_torch_s``, ``import_model_s``, ``cuda_context_s``: a fresh Python
  process that does nothing, imports torch, imports what the worker imports (torch, the
  transformers model class, the worker's own modules), and imports torch and makes its CUDA
  context: the fixed costs of any new process.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image" / "src"))

PATH = os.pathsep.join(
    [
        str(REPO / "worker_image/src"),
        str(REPO / "protos/gen/python"),
        os.environ.get("PYTHONPATH", ""),
    ]
)
WORKER_IMPORTS = (
    "import torch; from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM; "
    "import omnistage_worker.serving.server, omnistage_worker.runners.causal_lm, "
    "omnistage_worker.serving.openai_http"
)
"""What the worker imports before its first token (its own modules, torch, the model class)."""
MiB = 1024**2
GiB = 1024**3
Json = dict[str, Any]
CHUNK = 16 * MiB


def weight_files(model_dir: Path) -> list[Path]:
    return sorted(model_dir.glob("*.safetensors"))


def evict(paths: Sequence[Path]) -> None:
    """Write back, then drop these files' pages from the page cache (POSIX_FADV_DONTNEED)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def drop_all_caches() -> bool:
    """``echo 3 > /proc/sys/vm/drop_caches`` (every clean page of the machine); False where not
    permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def resident_fraction(paths: Sequence[Path]) -> float:
    """The share of these files' pages in the page cache now (mincore over a mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    resident = total = 0
    for path in paths:
        size = path.stat().st_size
        if size == 0:
            continue
        pages = (size + page - 1) // page
        vec = (ctypes.c_ubyte * pages)()
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
            try:
                if libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), "mincore failed")
            finally:
                libc.munmap(addr, size)
        finally:
            os.close(fd)
        resident += sum(v & 1 for v in bytes(vec))
        total += pages
    return resident / total if total else 0.0


def read_files(paths: Sequence[Path], threads: int = 8) -> tuple[int, float]:
    """Read every byte with ``threads`` readers into reused buffers; (bytes, seconds)."""
    work = [(p, off) for p in paths for off in range(0, p.stat().st_size, CHUNK)]
    lock = threading.Lock()
    total = [0]

    def reader() -> None:
        buf = bytearray(CHUNK)
        view = memoryview(buf)
        fds: dict[Path, int] = {}
        got = 0
        while True:
            with lock:
                if not work:
                    break
                path, offset = work.pop()
            fd = fds.get(path)
            if fd is None:
                fd = fds[path] = os.open(path, os.O_RDONLY)
            got += os.preadv(fd, [view], offset)
        for fd in fds.values():
            os.close(fd)
        with lock:
            total[0] += got

    started = time.perf_counter()
    workers = [threading.Thread(target=reader) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return total[0], time.perf_counter() - started


def process_seconds(code: str, runs: int = 1) -> float:
    """Wall seconds of a fresh ``python -c code`` (best of ``runs``)."""
    seconds = []
    env = os.environ | {"PYTHONPATH": PATH}
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True, env=env)
        seconds.append(time.perf_counter() - started)
    return min(seconds)


def gpu_limits(paths: Sequence[Path]) -> Json:
    """Pinned H2D and the engine's file-to-device stream (CUDA only)."""
    import torch

    from omnistage_worker.engine.host_memory import HostBuffer
    from omnistage_worker.engine.layout import CopyRun
    from omnistage_worker.engine.reload import FileLoader, FileRun

    dev = torch.device("cuda")
    torch.zeros(1, device=dev)
    size = 4 * GiB
    host = HostBuffer(size, pin=True)
    host.tensor.fill_(7)
    gpu = torch.empty(size, dtype=torch.uint8, device=dev)
    h2d = []
    for _ in range(4):
        torch.cuda.synchronize()
        started = time.perf_counter()
        gpu.copy_(host.tensor, non_blocking=True)
        torch.cuda.synchronize()
        h2d.append(time.perf_counter() - started)
    del gpu
    host.release()
    torch.cuda.empty_cache()
    runs, offset = [], 0
    for path in paths:
        size = path.stat().st_size
        runs.append(FileRun(path, CopyRun(0, offset, size)))
        offset += size
    flat = torch.empty(offset, dtype=torch.uint8, device=dev)
    loader = FileLoader(dev)
    stream = []
    for _ in range(2):
        started = time.perf_counter()
        loader.load(runs, flat)
        stream.append(time.perf_counter() - started)
    loader.release()
    return {
        "h2d_gbps": 4 * GiB / min(h2d) / 1e9,
        "engine_stream_gbps": offset / min(stream) / 1e9,
    }


def measure(model_dir: Path, cuda: bool) -> Json:
    paths = weight_files(model_dir)
    nbytes, _ = read_files(paths)  # warms the page cache
    reads = [read_files(paths)[1] for _ in range(2)]
    out: Json = {"weight_bytes": nbytes, "read_gbps": nbytes / min(reads) / 1e9}
    if cuda:
        out.update(gpu_limits(paths))
    out["python_s"] = process_seconds("pass")
    out["import_torch_s"] = process_seconds("import torch")
    # the second run finds the bytecode the first one cached (where caching is allowed)
    out["import_model_s"] = process_seconds(WORKER_IMPORTS, runs=2)
    if cuda:
        out["cuda_context_s"] = process_seconds("import torch; torch.zeros(1, device='cuda')")
    return out


if __name__ == "__main__":
    print(json.dumps(measure(Path(sys.argv[1]), sys.argv[2] == "cuda")))
