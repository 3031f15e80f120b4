"""Why a 2-GPU level-1 wake reached 0.74-0.76 of each device's copy limit (issue 23), and how
the engine's wake does now: one probe.

Every variant copies ``--gib`` per device on both devices at once (bare copies: one thread per
device and a barrier, as ``bench/multi_gpu.py``'s limit does, or one thread for both) and
reports each device's GB/s beside (a) the limit exactly as ``bench/multi_gpu.py`` measures it
(``bench/copy_limits.py``, in a child process) and (b) the same limit in this process at this
size. A variant changes one thing at a time: the host buffer (``bench/multi_gpu_probe_host.py``),
how the copy is issued (one copy, 64 MiB pieces), the destination (kept, or allocated in the
step: after the memory settled, just freed by this process, or just freed by another process as
in a hand-over, optionally with a ballast so that the new allocation must reuse what was
freed), and the worker's own :class:`ShardedEngine` wake on a synthetic model of 16 blocks of 9
tensors per device (``bench/multi_gpu_probe_engine.py``): as the worker runs it (one thread
issues every device's pieces), one device at a time, one thread per device (the issue before),
and beside a busy Python thread with and without the lowered switch interval. ``VARIANTS`` in
``bench/multi_gpu_probe_report.py`` says what each variant tests, ``HYPOTHESES`` which ratio
decides each hypothesis; the JSON's ``summary.evidence`` holds those ratios.

On the lent ``nvidia-h200-x2``, every variant (about 3 minutes), or the engine's check alone
(``ENGINE_CHECK``, about 2 minutes):

    python bench/multi_gpu_probe.py --gib 8 --out $OUT/multi_gpu_probe.json
    python bench/multi_gpu_probe.py --gib 8 --engine-check --out $OUT/multi_gpu_engine.json

On CPU it checks its own logic (1 MiB pieces of 8 MiB, two simulated devices, a CPU peer, NUMA
placement on node 0; no limits, events or NVML):

    python bench/multi_gpu_probe.py --dry-run
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.multi_gpu_probe_engine import EngineRig, busy_thread, together  # noqa: E402
from bench.multi_gpu_probe_host import (  # noqa: E402
    HostSide,
    Peer,
    ack_reads,
    child_peer,
    gpu_node,
    make_host,
    online_nodes,
    pattern_ok,
    topology,
)
from bench.multi_gpu_probe_report import (  # noqa: E402
    ENGINE_CHECK,
    HYPOTHESES,
    VARIANTS,
    Variant,
    summarize,
)
from bench.reporting import code_version, emit  # noqa: E402
from omnistage_worker.engine import gil  # noqa: E402
from omnistage_worker.engine.pinning import CHUNK_BYTES, split_copy  # noqa: E402

Json = dict[str, Any]
GiB = 1024**3
MiB = 1024**2
DEVICES = 2


def log(msg: str) -> None:
    print(f"[multi_gpu_probe {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass
class Setup:
    devices: list[torch.device]
    size: int
    chunk: int
    repeats: int
    settle: float
    cuda: bool


def sync(setup: Setup, i: int) -> None:
    if setup.cuda:
        torch.cuda.synchronize(i)


def release_device(setup: Setup) -> None:
    if setup.cuda:
        for i in range(len(setup.devices)):
            torch.cuda.synchronize(i)
        torch.cuda.empty_cache()


class Probe:
    """Runs variants; remembers the host buffers, the kept destinations and the last free."""

    def __init__(self, setup: Setup, peer: Peer) -> None:
        self.setup = setup
        self.peer = peer
        self.hosts: dict[str, list[HostSide]] = {}
        self.warm: list[torch.Tensor] = []
        self.last_free = 0.0
        self.engine: EngineRig | None = None
        self.ballast: Json | None = None

    # -- conditions ----------------------------------------------------------------------------

    def freed(self) -> None:
        release_device(self.setup)
        self.last_free = time.monotonic()

    def settled(self) -> None:
        wait = self.last_free + self.setup.settle - time.monotonic()
        if wait > 0:
            time.sleep(wait)

    def prepare(self, condition: str) -> None:
        """Bring the devices into ``condition`` just before the timed step."""
        s = self.setup
        if condition == "own_free":
            self.settled()
            scratch = [torch.empty(s.size, dtype=torch.uint8, device=d) for d in s.devices]
            for block in scratch:
                block.fill_(3)
            del scratch
            self.freed()
        elif condition in ("peer_free", "peer_free_ballast"):
            self.peer.ask(f"alloc {s.size}")
            self.settled()
            self.peer.ask("free")  # returns once the peer gave its memory back to the driver
            self.last_free = time.monotonic()
        else:
            self.settled()

    def set_ballast(self, on: bool) -> None:
        if on and self.ballast is None:
            self.drop_warm()
            if self.engine is not None:  # asleep: a wake then needs what the peer frees
                self.engine.sleep()
            self.freed()
            # Taken while the peer holds nothing else: room for its hand-over block (allocated
            # and freed before every round) and half a share more (the bench's default), so
            # the wake must reuse what the peer freed; a GiB spare for the allocators' rounding.
            room = self.setup.size + self.setup.size // 2 + GiB
            self.ballast = self.peer.ask(f"ballast {room}")
        elif not on and self.ballast is not None:
            self.peer.ask("unballast")
            self.ballast = None

    # -- buffers -------------------------------------------------------------------------------

    def host(self, kind: str) -> list[HostSide]:
        if kind not in self.hosts:
            started = time.perf_counter()
            s = self.setup
            self.hosts[kind] = [
                make_host(kind, s.size, i, s.cuda, s.chunk) for i in range(len(s.devices))
            ]
            log(f"host buffers {kind}: {time.perf_counter() - started:.1f}s")
        return self.hosts[kind]

    def drop_host(self, kind: str) -> None:
        for side in self.hosts.pop(kind, []):
            side.release()

    def warm_dests(self) -> list[torch.Tensor]:
        if not self.warm:
            s = self.setup
            self.warm = [torch.empty(s.size, dtype=torch.uint8, device=d) for d in s.devices]
            for block in self.warm:
                block.fill_(0)
            self.freed()  # nothing freed, but the fills are done and the clock starts
        return self.warm

    def drop_warm(self) -> None:
        if self.warm:
            self.warm = []
            self.freed()

    # -- copy variants -------------------------------------------------------------------------

    def copy_round(self, v: Variant, hosts: list[HostSide], check: bool) -> list[Json]:
        s = self.setup
        targets: list[torch.Tensor | None] = [None] * len(s.devices)

        def issue(i: int) -> Json:
            t0 = time.perf_counter()
            dst = (
                self.warm[i]
                if v.dest == "warm"
                else torch.empty(s.size, dtype=torch.uint8, device=s.devices[i])
            )
            t1 = time.perf_counter()
            events = None
            if s.cuda:
                events = [torch.cuda.Event(enable_timing=True)]  # type: ignore[no-untyped-call]
                events[0].record(torch.cuda.current_stream(i))
            if v.issue == "one":
                dst.copy_(hosts[i].tensor, non_blocking=True)
            else:
                split_copy(dst, hosts[i].tensor, 0, s.chunk)
            if events is not None:
                end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
                end.record(torch.cuda.current_stream(i))
                events.append(end)
            targets[i] = dst
            return {
                "t0": t0,
                "alloc_s": t1 - t0,
                "issue_s": time.perf_counter() - t1,
                "events": events,
            }

        def finish(i: int, out: Json) -> Json:
            sync(s, i)
            out["seconds"] = time.perf_counter() - out.pop("t0")
            events = out.pop("events")
            if events:
                out["gpu_s"] = max(events[0].elapsed_time(e) for e in events[1:]) / 1e3
            return out

        if v.alone:
            results = [finish(i, issue(i)) for i in range(len(s.devices))]
        elif not v.one_thread:
            results = together(len(s.devices), lambda i: finish(i, issue(i)))
        else:  # one thread issues both, then waits for each
            issued = [issue(i) for i in range(len(s.devices))]
            start = issued[0]["t0"]
            results = []
            for i, out in enumerate(issued):
                out["t0"] = start
                results.append(finish(i, out))
        if check:
            for i, target in enumerate(targets):
                assert target is not None
                results[i]["bytes_ok"] = pattern_ok(target, i)
        targets.clear()
        if v.dest == "fresh":
            self.freed()
        return results

    # -- engine variants -----------------------------------------------------------------------

    def engine_round(self, v: Variant, check: bool) -> list[Json]:
        if self.engine is None:
            started = time.perf_counter()
            self.engine = EngineRig(self.setup.devices, self.setup.size, self.setup.cuda)
            log(f"engine built, activated and pinned: {time.perf_counter() - started:.1f}s")
        rig = self.engine
        if v.condition == "own_free":  # the wake right after the engine's own sleep
            self.settled()
            rig.sleep()
            self.freed()
        else:
            rig.sleep()
            self.freed()
            self.prepare(v.condition)
        interval = gil.SWITCH_INTERVAL_S
        gil.SWITCH_INTERVAL_S = interval if v.switch else None
        try:
            with busy_thread(v.gil_busy):
                results = rig.wake(alone=v.alone, threads=v.threads)
        finally:
            gil.SWITCH_INTERVAL_S = interval
        if check:
            for i, ok in enumerate(rig.bytes_ok()):
                results[i]["bytes_ok"] = ok
        return results

    # -- one variant ---------------------------------------------------------------------------

    def run(self, v: Variant) -> Json:
        s = self.setup
        out: Json = {"tests": v.tests, "variant": dict(v.__dict__)}
        if v.host == "numa" and s.cuda and len(online_nodes()) < 2:
            nodes = online_nodes()
            out["skipped"] = f"one NUMA node online ({nodes}): the same as 'limit'"
            out["gpu_nodes"] = [gpu_node(i) for i in range(len(s.devices))]
            return out
        self.set_ballast(v.condition == "peer_free_ballast")
        if v.host != "engine" and v.dest == "warm":
            self.warm_dests()
        elif self.warm:
            self.drop_warm()
        rounds = []
        for r in range(s.repeats):
            check = r == s.repeats - 1
            if v.host == "engine":
                rounds.append(self.engine_round(v, check))
            else:
                hosts = self.host(v.host)
                self.prepare(v.condition)
                rounds.append(self.copy_round(v, hosts, check))
        if v.host in ("hostalloc", "numa"):
            out["host_facts"] = [side.facts for side in self.hosts[v.host]]
            self.drop_host(v.host)
        out["rounds"] = rounds
        if self.ballast is not None:
            out["ballast"] = self.ballast
        return out

    def close(self) -> None:
        self.set_ballast(False)
        if self.engine is not None:
            self.engine.close()
        for kind in list(self.hosts):
            self.drop_host(kind)


def multi_gpu_limit(gib: float) -> Json:
    """``bench/copy_limits.py`` in a child process, as ``bench/multi_gpu.py`` runs it."""
    script = REPO / "bench" / "copy_limits.py"
    done = subprocess.run(
        [sys.executable, str(script), str(gib)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    result: Json = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def code() -> str | None:
    """The tree's commit (None where neither a COMMIT file nor git is there)."""
    try:
        return code_version(REPO)
    except OSError:
        return None


def run(args: argparse.Namespace) -> Json:
    cuda = not args.dry_run
    if cuda and torch.cuda.device_count() < DEVICES:
        raise SystemExit(f"needs {DEVICES} CUDA devices (or --dry-run)")
    size = (8 * MiB) if args.dry_run else int(args.gib * GiB) // MiB * MiB
    setup = Setup(
        devices=[torch.device(f"cuda:{i}" if cuda else "cpu") for i in range(DEVICES)],
        size=size,
        chunk=MiB if args.dry_run else CHUNK_BYTES,
        repeats=args.repeats,
        settle=0.01 if args.dry_run else args.settle,
        cuda=cuda,
    )
    started = time.monotonic()
    report: Json = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "code": code(),
        "dry_run": args.dry_run,
        "bytes_per_device": size,
        "piece_bytes": setup.chunk,
        "repeats": setup.repeats,
        "settle_seconds": setup.settle,
        "torch": torch.__version__,
        "gil_switch_interval_s": sys.getswitchinterval(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(DEVICES)] if cuda else None,
        "topology": topology(cuda, DEVICES),
        "hypotheses": HYPOTHESES,
    }
    if cuda:
        log("the limit as bench/multi_gpu.py measures it (child process)")
        report["multi_gpu_limit"] = multi_gpu_limit(args.limit_gib)
        for i in range(DEVICES):
            torch.zeros(1, device=f"cuda:{i}")
    peer = Peer(Path(__file__), DEVICES, cuda)
    probe = Probe(setup, peer)
    variants: Json = {}
    try:
        only = ENGINE_CHECK if args.engine_check else [n for n in args.only.split(",") if n]
        for v in VARIANTS:
            if only and v.name not in only:
                continue
            if any(word and word in v.name for word in args.skip.split(",")):
                variants[v.name] = {"tests": v.tests, "skipped": "--skip"}
                continue
            if time.monotonic() - started > args.budget_s:
                variants[v.name] = {"tests": v.tests, "skipped": "out of the time budget"}
                continue
            log(f"{v.name}: {v.tests}")
            try:
                variants[v.name] = probe.run(v)
            except Exception as exc:  # one failing variant must not lose the others
                log(f"{v.name} failed: {exc!r}")
                variants[v.name] = {"tests": v.tests, "error": repr(exc)}
        if cuda:
            try:
                report["ack_reads"] = ack_reads(DEVICES)
            except Exception as exc:
                report["ack_reads"] = {"error": repr(exc)}
    finally:
        for close in (probe.close, peer.close):
            try:
                close()
            except Exception as exc:  # the figures taken so far still count
                log(f"closing: {exc!r}")
    report["variants"] = variants
    report["seconds"] = time.monotonic() - started
    report["summary"] = summarize(report)
    return report


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        if sys.argv[2] == "peer":
            child_peer(int(sys.argv[3]), sys.argv[4] == "1")
            return
        raise SystemExit(f"unknown child {sys.argv[2]}")
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="bytes copied per device (GiB)")
    parser.add_argument("--limit-gib", type=float, default=4.0, help="bench/multi_gpu.py's size")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--settle", type=float, default=1.5, help="seconds after a free")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip variants after it")
    parser.add_argument("--skip", default="", help="skip variants whose name has any of these")
    parser.add_argument("--only", default="", help="run only these variants (names, commas)")
    parser.add_argument(
        "--engine-check", action="store_true", help="run only ENGINE_CHECK (the engine's wake)"
    )
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny, simulated devices")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.dry_run:
        args.repeats = min(args.repeats, 2)
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
