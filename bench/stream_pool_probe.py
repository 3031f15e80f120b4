"""What a process keeps on the GPU after CUDA streams and graphs (the decode batcher's capture
stream, ``runners/step_graphs.py``): NVML's figure for this process after each step, the caches
emptied. On the GPU host (the run and its output: bench/results/stream_pool_probe.txt)::

    python3 bench/stream_pool_probe.py

Steps: the CUDA context; an eager matmul; ``torch.cuda.Stream()`` (PyTorch makes its pool of
side streams on the first one asked for); a matmul on that stream; a graph captured on it,
alive, then destroyed; a stream made with ``cudaStreamCreate``, then destroyed.
"""

from __future__ import annotations

import ctypes
import os

import pynvml
import torch


def used_mib(handle: object) -> int:
    """NVML's figure for this process, in MiB, after the caches are emptied."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid():
            return int(proc.usedGpuMemory) // 2**20
    return -1


def main() -> None:
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    torch.zeros(1, device="cuda")
    print("context", used_mib(handle))
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = a @ a
    del b
    print("after eager matmul", used_mib(handle))
    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    print("after torch.cuda.Stream()", used_mib(handle))
    with torch.cuda.stream(side):
        b = a @ a
    torch.cuda.current_stream().wait_stream(side)
    del b
    print("after matmul on side stream", used_mib(handle))
    graph = torch.cuda.CUDAGraph()
    x = torch.randn(16, 4096, device="cuda", dtype=torch.bfloat16)
    with torch.cuda.graph(graph, stream=side, capture_error_mode="thread_local"):
        y = (x @ a).relu()
    graph.replay()
    print("graph alive", used_mib(handle))
    del graph, y
    print("graph destroyed", used_mib(handle))
    stream = ctypes.c_void_p()
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    print("create err", cudart.cudaStreamCreate(ctypes.addressof(stream)))
    print("after own cudaStreamCreate", used_mib(handle))
    cudart.cudaStreamDestroy(stream.value)
    print("after destroy", used_mib(handle))


if __name__ == "__main__":
    main()
