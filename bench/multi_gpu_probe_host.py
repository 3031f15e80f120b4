"""The host side of ``bench/multi_gpu_probe.py``: host buffers of each kind, NUMA placement,
the machine's topology, byte patterns, and the peer process that frees memory (a hand-over).

Host buffer kinds (one per device, ``size`` bytes, filled with the device's byte pattern):

- ``whole``: the engine's :class:`HostBuffer`, filled, then page-locked as ONE registration
  (``cuMemHostRegister``, portable): how ``bench/multi_gpu.py`` measures its limit;
- ``chunks``: the engine's :class:`ChunkPinner` (one registration per 64 MiB chunk), pinned to
  the end: the host copy a worker's wake copies from;
- ``hostalloc``: ``torch.empty(pin_memory=True)``: page-locked by ``cudaHostAlloc``;
- ``numa``: ``whole``, its pages first placed (``mbind``, preferred) on the GPU's NUMA node.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "worker_image/src"))

from omnistage_worker.engine.host_memory import HostBuffer  # noqa: E402
from omnistage_worker.engine.pinning import ChunkPinner, CudaLocker, PageLocker  # noqa: E402

Json = dict[str, Any]
MiB = 1024**2
PATTERN_BLOCK = MiB
"""Each 1 MiB block of a buffer holds one byte value: a piece copied to the wrong place shows."""

_SYS_MBIND = 237  # x86_64 system call numbers
_SYS_MOVE_PAGES = 279
_MPOL_PREFERRED = 1


# ---- byte patterns ---------------------------------------------------------------------------


def _values(nblocks: int, salt: int, device: torch.device) -> torch.Tensor:
    return ((torch.arange(nblocks, device=device) * 31 + salt) % 251).to(torch.uint8)


def pattern_fill(buffer: torch.Tensor, salt: int) -> None:
    """Fill a 1-D uint8 buffer (a whole number of blocks) block by block."""
    blocks = buffer.numel() // PATTERN_BLOCK
    values = _values(blocks, salt, buffer.device)
    buffer.view(blocks, PATTERN_BLOCK).copy_(values[:, None].expand(blocks, PATTERN_BLOCK))


def pattern_ok(buffer: torch.Tensor, salt: int, slab_blocks: int = 1024) -> bool:
    """Whether ``buffer`` holds :func:`pattern_fill`'s bytes (checked 1 GiB at a time)."""
    blocks = buffer.numel() // PATTERN_BLOCK
    values = _values(blocks, salt, buffer.device)
    grid = buffer.view(blocks, PATTERN_BLOCK)
    for start in range(0, blocks, slab_blocks):
        end = min(blocks, start + slab_blocks)
        if not bool((grid[start:end] == values[start:end, None]).all()):
            return False
    return True


# ---- NUMA ------------------------------------------------------------------------------------


def online_nodes() -> list[int]:
    """The host's online NUMA nodes (``[0]`` where the kernel shows none)."""
    try:
        text = Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return [0]
    nodes: list[int] = []
    for part in text.split(","):
        low, _, high = part.partition("-")
        nodes.extend(range(int(low), int(high or low) + 1))
    return nodes


def gpu_pci(index: int) -> str | None:
    """The sysfs name of a CUDA device's PCI function (``0000:19:00.0``)."""
    try:
        props = torch.cuda.get_device_properties(index)
        domain, bus, dev = (getattr(props, f"pci_{k}_id") for k in ("domain", "bus", "device"))
    except Exception:
        return None
    return f"{domain:04x}:{bus:02x}:{dev:02x}.0"


def gpu_node(index: int) -> int | None:
    """The NUMA node sysfs gives a CUDA device (None: unknown or -1)."""
    pci = gpu_pci(index)
    if pci is None:
        return None
    try:
        node = int(Path(f"/sys/bus/pci/devices/{pci}/numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def _syscall(number: int, *args: Any) -> tuple[int, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.syscall(number, *args))
    return rc, ctypes.get_errno()


def bind_preferred(buffer: torch.Tensor, node: int) -> str:
    """Place the (untouched) pages of ``buffer`` on ``node`` where possible; "" or the error."""
    if platform.machine() != "x86_64":
        return f"mbind: not on {platform.machine()}"
    mask = ctypes.c_ulong(1 << node)
    nbytes = buffer.numel() * buffer.element_size()
    rc, errno = _syscall(
        _SYS_MBIND,
        ctypes.c_void_p(buffer.data_ptr()),
        ctypes.c_ulong(nbytes),
        ctypes.c_int(_MPOL_PREFERRED),
        ctypes.byref(mask),
        ctypes.c_ulong(64),
        ctypes.c_uint(0),
    )
    return "" if rc == 0 else f"mbind failed: errno {errno}"


def page_nodes(buffer: torch.Tensor, samples: int = 16) -> list[int] | str:
    """The NUMA node of ``samples`` pages spread over ``buffer`` (negative: -errno)."""
    if platform.machine() != "x86_64" or buffer.numel() == 0:
        return "not measured"
    page = os.sysconf("SC_PAGE_SIZE")
    base, nbytes = buffer.data_ptr(), buffer.numel() * buffer.element_size()
    addrs = [(base + k * nbytes // samples) // page * page for k in range(samples)]
    pages = (ctypes.c_void_p * samples)(*addrs)
    status = (ctypes.c_int * samples)()
    rc, errno = _syscall(
        _SYS_MOVE_PAGES, 0, ctypes.c_ulong(samples), pages, None, status, ctypes.c_int(0)
    )
    return list(status) if rc == 0 else f"move_pages failed: errno {errno}"


# ---- host buffers ----------------------------------------------------------------------------


class NoLock:
    """CPU: nothing to page-lock."""

    def lock(self, ptr: int, nbytes: int) -> None:
        del ptr, nbytes

    def unlock(self, ptr: int, nbytes: int) -> None:
        del ptr, nbytes


@dataclass
class HostSide:
    """One device's host buffer, how to give it back, and what is known about it."""

    tensor: torch.Tensor
    release: Callable[[], None]
    facts: Json = field(default_factory=dict)


def make_host(kind: str, size: int, index: int, cuda: bool, chunk: int) -> HostSide:
    """Device ``index``'s host buffer of ``kind`` (see the module's docstring)."""
    facts: Json = {"kind": kind}
    if kind in ("whole", "numa"):
        host = HostBuffer(size, pin=False)
        if kind == "numa":
            node = gpu_node(index) if cuda else 0  # CPU: node 0 (checks the calls)
            facts["gpu_node"] = node
            facts["bind"] = bind_preferred(host.tensor, node) if node is not None else "no node"
        pattern_fill(host.tensor, index)
        if cuda:
            host.pin()
        facts["page_nodes"] = page_nodes(host.tensor)
        return HostSide(host.tensor, host.release, facts)
    if kind == "chunks":
        locker: PageLocker = CudaLocker() if cuda else NoLock()
        pinner = ChunkPinner(size, locker, chunk_bytes=chunk, pause_s=0.0)
        pattern_fill(pinner.buffer.tensor, index)
        pinner.finish()
        facts["pinned_bytes"] = pinner.pinned_bytes
        facts["page_nodes"] = page_nodes(pinner.buffer.tensor)
        if pinner.error is not None:
            facts["error"] = str(pinner.error)
        return HostSide(pinner.buffer.tensor, pinner.release, facts)
    if kind == "hostalloc":
        tensor = torch.empty(size, dtype=torch.uint8, pin_memory=cuda)
        pattern_fill(tensor, index)
        facts["page_nodes"] = page_nodes(tensor)
        holder = [tensor]

        def release() -> None:
            holder.clear()
            with contextlib.suppress(Exception):
                torch._C._host_emptyCache()

        return HostSide(tensor, release, facts)
    raise ValueError(f"unknown host buffer kind {kind!r}")


# ---- topology --------------------------------------------------------------------------------


def _run(argv: list[str]) -> str:
    if shutil.which(argv[0]) is None:
        return f"{argv[0]}: not installed"
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    return (done.stdout + done.stderr).strip()


def _async_engines(index: int) -> int | None:
    """``CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT`` through the driver (None: unreadable)."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        device, value = ctypes.c_int(), ctypes.c_int()
        if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(device), index) != 0:
            return None
        if lib.cuDeviceGetAttribute(ctypes.byref(value), 40, device) != 0:
            return None
        return int(value.value)
    except OSError:
        return None


def topology(cuda: bool, devices: int) -> Json:
    """Where the GPUs sit: nodes, their PCI links and copy engines, ``nvidia-smi topo -m``."""
    out: Json = {"numa_nodes_online": online_nodes(), "cpus": os.cpu_count()}
    with contextlib.suppress(OSError):
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
        out["transparent_hugepage"] = thp
    out["numactl_hardware"] = _run(["numactl", "--hardware"])
    if not cuda:
        return out
    out["nvidia_smi_topo"] = _run(["nvidia-smi", "topo", "-m"])
    gpus = []
    for i in range(devices):
        gpu: Json = {"index": i, "pci": gpu_pci(i), "numa_node": gpu_node(i)}
        gpu["async_engine_count"] = _async_engines(i)
        with contextlib.suppress(Exception):
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            gpu["pcie_gen"] = int(pynvml.nvmlDeviceGetCurrPcieLinkGeneration(handle))
            gpu["pcie_width"] = int(pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle))
            gpu["driver"] = str(pynvml.nvmlSystemGetDriverVersion())
        gpus.append(gpu)
    out["gpus"] = gpus
    return out


# ---- the peer: another process that frees device memory (the stage that just slept) ---------


def child_peer(devices: int, cuda: bool) -> None:
    """Commands on stdin, one reply line each: ``alloc N`` (N bytes per device, written),
    ``free`` (freed and returned to the driver), ``ballast ROOM`` (take all but ROOM bytes of
    each device's free memory), ``unballast``, ``quit``."""
    names = [f"cuda:{i}" if cuda else "cpu" for i in range(devices)]
    for name in names:
        torch.zeros(1, device=name)
    blocks: list[torch.Tensor] = []
    ballast: list[torch.Tensor] = []

    def settle() -> None:
        if cuda:
            for i in range(devices):
                torch.cuda.synchronize(i)
            torch.cuda.empty_cache()

    print("ready", flush=True)
    for line in sys.stdin:
        command, *args = line.split()
        reply: Json = {}
        if command == "alloc":
            blocks = []
            try:
                blocks = [torch.empty(int(args[0]), dtype=torch.uint8, device=n) for n in names]
            except torch.OutOfMemoryError as exc:  # answered: the probe's other variants go on
                reply["error"] = str(exc).splitlines()[0]
            for block in blocks:
                block.fill_(1)
            settle()
        elif command == "free":
            blocks = []
            settle()
        elif command == "ballast":
            sizes = []
            for i, name in enumerate(names):
                free = torch.cuda.mem_get_info(i)[0] if cuda else 0
                size = max(0, free - int(args[0]))
                for _ in range(16):  # the allocator's rounding: a little less until it fits
                    try:
                        if size:
                            ballast.append(torch.empty(size, dtype=torch.uint8, device=name))
                        break
                    except torch.OutOfMemoryError:
                        size = max(0, size - 256 * MiB)
                sizes.append(size)
            reply["ballast_bytes"] = sizes
            settle()
        elif command == "unballast":
            ballast = []
            settle()
        elif command == "quit":
            break
        print(json.dumps(reply), flush=True)


class Peer:
    """The peer process, driven line by line."""

    def __init__(self, script: Path, devices: int, cuda: bool) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, str(script), "--child", "peer", str(devices), "1" if cuda else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        if self._readline() != "ready":
            raise RuntimeError("the peer process did not start")

    def _readline(self) -> str:
        stdout: IO[str] | None = self._proc.stdout
        assert stdout is not None
        return stdout.readline().strip()

    def ask(self, command: str) -> Json:
        """Send one command; its reply (raises when the peer died)."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        line = self._readline()
        if not line:
            raise RuntimeError(f"the peer process died on {command!r}")
        reply: Json = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the peer could not {command!r}: {reply['error']}")
        return reply

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ask("quit")
        with contextlib.suppress(Exception):
            self._proc.wait(30)
        if self._proc.poll() is None:
            self._proc.kill()


# ---- the Ack's NVML readings ----------------------------------------------------------------


def ack_reads(devices: int) -> Json:
    """Seconds of the worker's per-device NVML reading (an Ack takes two, before and after);
    the same NVML calls made directly where the worker's probe does not import here."""
    read: Callable[[], object]
    try:
        from omnistage_worker.memory.devices import DeviceProbes
        from omnistage_worker.memory.nvml import NvmlProbe

        read, source = DeviceProbes([NvmlProbe(i) for i in range(devices)]).read, "worker"
    except Exception as exc:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(devices)]

        def read() -> object:
            return [
                (pynvml.nvmlDeviceGetMemoryInfo(h), pynvml.nvmlDeviceGetComputeRunningProcesses(h))
                for h in handles
            ]

        source = f"pynvml directly (the worker's probe: {exc!r})"
    times = []
    for _ in range(10):
        started = time.perf_counter()
        read()
        times.append(time.perf_counter() - started)
    return {
        "source": source,
        "read_seconds_median": statistics.median(times),
        "read_seconds": times,
    }
