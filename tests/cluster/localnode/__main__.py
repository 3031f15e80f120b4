"""``python -m tests.cluster.localnode --kubeconfig K --nodes N``: fake GPU nodes until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import signal
import sys
import tempfile
from pathlib import Path

from tests.cluster.kubeconfig import load_kubeconfig
from tests.cluster.localnode.api import Api
from tests.cluster.localnode.container_run import Backoff
from tests.cluster.localnode.devices import (
    NodeSpec,
    node_address,
    nvml_records,
    octets_needed,
    real_gpu_devices,
)
from tests.cluster.localnode.kubelet import Kubelet
from tests.cluster.localnode.stats import STATS_FILE, report

_UNITS = {
    "": 1,
    "k": 1000,
    "M": 1000**2,
    "G": 1000**3,
    "T": 1000**4,
    "Ki": 1024,
    "Mi": 1024**2,
    "Gi": 1024**3,
    "Ti": 1024**4,
}


def parse_bytes(text: str) -> int:
    """``80Gi``, ``512Mi``, ``1000`` -> bytes."""
    m = re.fullmatch(r"(\d+)([kMGT]i?)?", text.strip())
    if m is None:
        raise argparse.ArgumentTypeError(f"not a byte quantity: {text!r} (use e.g. 80Gi)")
    return int(m.group(1)) * _UNITS[m.group(2) or ""]


def parse_activation(text: str) -> float | int:
    """``25%`` or ``0.25`` (a fraction of a process's weights) or ``512Mi`` (bytes)."""
    text = text.strip()
    try:
        if text.endswith("%"):
            return float(text[:-1]) / 100
        if "." in text:
            return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a fraction: {text!r}") from None
    return parse_bytes(text)


def build_nodes(
    count: int,
    *,
    gpus: int,
    gpu_memory: int,
    prefix: str,
    first: int,
    octet: int,
    gpu_reserve: int | None = None,
    gpu_context: int | None = None,
    gpu_activation: float | int = 0.25,
    real_gpus: list[dict[str, object]] | None = None,
) -> list[NodeSpec]:
    """NodeSpecs ``<prefix><first>``..; node i's address is ``127.<octet>.<i>.1``.

    ``real_gpus``: NVML records of the host's GPUs (real-GPU mode: one node only, since every
    node on this host would share them).
    """
    if real_gpus is not None and count != 1:
        raise ValueError("real-GPU mode runs one node: the host's GPUs cannot be shared by two")
    devices = real_gpu_devices(real_gpus) if real_gpus is not None else None
    return [
        NodeSpec(
            name=f"{prefix}{i}",
            index=i,
            gpus=gpus if devices is None else len(devices),
            gpu_memory=gpu_memory,
            address=node_address(octet, i),
            gpu_reserve=gpu_reserve,
            gpu_context=gpu_context,
            gpu_activation=gpu_activation,
            real_gpus=devices,
        )
        for i in range(first, first + count)
    ]


async def _serve(args: argparse.Namespace) -> None:
    api = Api(load_kubeconfig(args.kubeconfig))
    nodes = build_nodes(
        args.nodes,
        gpus=args.gpus,
        gpu_memory=args.gpu_memory,
        prefix=args.name_prefix,
        first=args.first_index,
        octet=args.ip_octet,
        gpu_reserve=args.gpu_reserve,
        gpu_context=args.gpu_context,
        gpu_activation=args.gpu_activation,
        real_gpus=nvml_records() if args.real_gpus else None,
    )
    kubelet = Kubelet(
        api,
        nodes,
        args.state_dir,
        Backoff(args.backoff_initial, args.backoff_max),
        not args.keep_nodes,
        watch_timeout=args.watch_timeout,
        sim_hosts=args.sim_hosts,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ready = asyncio.Event()
    main = asyncio.create_task(kubelet.run(ready))
    reporter = asyncio.create_task(report(api, kubelet, args.state_dir / STATS_FILE))
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait(
        {main, stopper, asyncio.create_task(ready.wait())}, return_when=asyncio.FIRST_COMPLETED
    )
    if ready.is_set():
        print(
            f"localnode ready: {len(nodes)} node(s) {nodes[0].name}..{nodes[-1].name} "
            f"(state {args.state_dir})",
            flush=True,
        )
        await asyncio.wait({main, stopper}, return_when=asyncio.FIRST_COMPLETED)
    logging.getLogger("localnode").info("shutting down")
    reporter.cancel()
    main.cancel()
    try:
        await main
    except asyncio.CancelledError:
        pass
    finally:
        await kubelet.shutdown()
        await api.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.localnode", description=__doc__)
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=2, help="fake GPUs per node")
    parser.add_argument(
        "--gpu-memory", type=parse_bytes, default=parse_bytes("80Gi"), help="bytes per GPU (80Gi)"
    )
    parser.add_argument(
        "--gpu-reserve",
        type=parse_bytes,
        default=None,
        help="simulated driver reserve per GPU (default 0.6%% of its memory)",
    )
    parser.add_argument(
        "--gpu-context",
        type=parse_bytes,
        default=None,
        help="simulated CUDA context per process (default 612Mi scaled to the GPU)",
    )
    parser.add_argument(
        "--gpu-activation",
        type=parse_activation,
        default=0.25,
        help="simulated activations per request: a fraction of the weights (25%%) or bytes",
    )
    parser.add_argument(
        "--real-gpus",
        action="store_true",
        help="publish the host's GPUs (NVML) and give pods their allocated GPU, no simulation",
    )
    parser.add_argument("--name-prefix", default="gpu-node-")
    parser.add_argument("--first-index", type=int, default=0)
    parser.add_argument("--ip-octet", type=int, default=10, help="pods get 127.<octet>.<node>.<n>")
    parser.add_argument("--state-dir", type=Path, default=None)
    parser.add_argument("--backoff-initial", type=float, default=1.0)
    parser.add_argument("--backoff-max", type=float, default=30.0)
    parser.add_argument("--keep-nodes", action="store_true", help="leave the Node objects on exit")
    parser.add_argument(
        "--watch-timeout", type=int, default=300, help="seconds before a pod watch is reopened"
    )
    parser.add_argument(
        "--sim-hosts",
        type=int,
        default=0,
        help="serve worker containers by this many simulated worker hosts "
        "(tests.scale.simhost; 0: a process per container)",
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    last_octet = args.ip_octet + octets_needed(args.first_index, args.nodes) - 1
    if not 1 <= args.ip_octet <= 254 or last_octet > 254:
        parser.error("--ip-octet must be 1..254, and nodes take one more per 250 up to 254")
    if args.real_gpus and args.nodes != 1:
        parser.error("--real-gpus runs one node (the host's GPUs cannot be shared by two)")
    if args.state_dir is None:
        args.state_dir = Path(tempfile.mkdtemp(prefix="localnode-"))
    args.state_dir.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
