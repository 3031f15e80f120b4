"""A wake that runs out of memory mid-copy, through the operator, on the real GPU.

The sibling of ``bench/gpu_wake_oom.py`` (the worker alone): the real control plane, localnode
in real-GPU mode, the operator and one real ``omnistage-worker`` pod on the GPU, as
``bench/gpu_e2e.py`` runs them, from the bundle of ``python -m bench.gpu_bundle``::

    python3 bench/gpu_wake_oom_operator.py --bundle ../.gpubundle --out $OUT/out.json

What it does:

1. builds a Llama-style LM with random bf16 weights (``--layers`` of the 16.6 GiB model's 36;
   default 6: about 3 GiB) and starts the cluster; the stage ``llm`` (no ``vram.request``)
   starts Asleep at level 1;
2. starts the tenant (``bench/wake_tenant.py``: its own CUDA process) and arms it: the next
   wake meets it between the operator's gate and the copy, where it takes all free memory but
   half of the weights; ``llm`` is patched Active;
3. the room comes and goes ``--flaps`` times: after each wake that ran out of memory the tenant
   leaves (the gate sees room again) and is armed again, so each wake the back-off lets through
   runs out too; after the last one the tenant leaves for good;
4. records every WakeUp the worker got (its launcher's log), every wake ACK (the worker's
   GetStatus, polled), the operator's rounds and wake transitions (its metrics, polled), the
   stage's Ready condition, ``wakeBackoff``, ``learnedNeedBytes`` and its Events.

Checks: the first failed wake's ACK is not ok, says out of memory, is back asleep at level 1
with nothing left on the device and says how much more it needed; the stage shows Ready=False
``WakeOutOfMemory`` with those bytes and a Warning Event; the gaps between wakes follow the
back-off (1, 2, 4, ... s), fewer wakes than rounds; ``llm`` Active once the tenant left, its
wake ok. ``--tiny``: the same on this machine (tiny model on CPU, localnode's simulated GPU,
whose ``tenant_on_copy`` fault plays the tenant), to test the script.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
for _p in reversed([ROOT / "operator" / "src", ROOT / "worker_image" / "src",
                    ROOT / "protos" / "gen" / "python", ROOT]):  # fmt: skip
    sys.path.insert(0, str(_p))

from bench.gpu_e2e_cluster import (  # noqa: E402
    TOKEN,
    Operator,
    stage_manifest,
    stage_status,
    start_localnode,
    wait_states,
)
from bench.gpu_e2e_host import nvml_devices, unpack_bundle, versions  # noqa: E402
from bench.wake_tenant import TenantFiles  # noqa: E402

Json = dict[str, Any]
MiB = 1 << 20
STAGE = "llm"


def log(msg: str) -> None:
    print(f"[gpu_wake_oom_operator {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_model(work: Path, layers: int, tiny: bool) -> int:
    """The LM in a child process (the bench itself stays off the GPU); its weight bytes."""
    code = (
        "import sys; from pathlib import Path; from bench.gpu_wake_oom import build_model; "
        f"print(build_model(Path({str(work / 'llm')!r}), {layers}, {tiny}))"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False,
                          cwd=ROOT, timeout=900)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"model build failed:\n{proc.stderr[-3000:]}")
    return int(proc.stdout.split()[-1])


def worker_shim(work: Path, tenant_dir: Path) -> None:
    """``omnistage-worker`` (first on PATH, as ``unpack_bundle`` made it) installs the tenant's
    hook before the worker's own ``main``."""
    script = work / "shims" / "omnistage-worker"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nfrom bench.wake_tenant import install\n"
        f"install({str(tenant_dir)!r})\nfrom omnistage_worker.cli import main\nsys.exit(main())\n"
    )
    script.chmod(0o755)


class GpuTenant:
    """The real tenant: its own CUDA process, driven through ``TenantFiles``."""

    def __init__(self, directory: Path, leave: int) -> None:
        self.files = TenantFiles(directory)
        here = Path(__file__).resolve().parent / "wake_tenant.py"
        self.proc = subprocess.Popen([sys.executable, str(here), str(directory), str(leave)])
        deadline = time.monotonic() + 120
        while not (directory / "tenant.up").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the tenant did not start")
            time.sleep(0.05)

    def arm(self) -> None:
        self.files.arm()

    def release(self) -> None:
        self.files.release()

    def took(self) -> int:
        return self.files.taken_bytes()

    def wakes(self) -> list[float]:
        return self.files.wakes()

    def stop(self) -> None:
        self.files.stop()
        self.proc.terminate()
        self.proc.wait(30)


class SimTenant:
    """The simulated GPU's ``tenant_on_copy`` fault: this process takes the room at the copy."""

    def __init__(self, gpu: Any, leave: int) -> None:
        self.gpu, self.leave, self.me, self.take = gpu, leave, os.getpid(), 0

    def arm(self) -> None:
        self.take = self.gpu.snapshot().free - self.leave
        self.gpu.set_faults(None, tenant_on_copy=[self.me, self.take])

    def release(self) -> None:
        self.gpu.withdraw(self.me)

    def took(self) -> int:
        return self.take

    def wakes(self) -> list[float]:
        return []  # no launcher hook: the ACKs count the wakes

    def stop(self) -> None:
        self.gpu.set_faults(None, tenant_on_copy=None)
        self.gpu.withdraw(self.me)


def worker_report(cp: Any, ns: str) -> Any:
    """The worker's own GetStatus (``WorkerReport``), dialled at its pod IP."""
    from omnistage_operator.decisions.handover import WorkerUnavailable
    from omnistage_operator.k8s.worker_client import WorkerClient

    pod = cp.get_json("pod", f"{STAGE}-worker", namespace=ns)
    ip = pod.get("status", {}).get("podIP")
    if not ip:
        return None
    ports = [p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])]

    async def call() -> Any:
        client = WorkerClient(f"{ip}:{ports[0] if ports else 50051}", token=TOKEN)
        try:
            return await client.get_status(2.0)
        except WorkerUnavailable:
            return None
        finally:
            await client.close()

    return asyncio.run(call())


def scrape(port: int) -> Json:
    """The operator's rounds and wake transitions (summed over labels) from its metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as resp:
        text = resp.read().decode()
    out: Json = {"rounds": 0.0, "wakes": {}}
    for line in text.splitlines():
        if line.startswith("omnistage_rounds_total{"):
            out["rounds"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("omnistage_transitions_total{") and 'op="wake"' in line:
            result = re.search(r'result="([^"]*)"', line)
            key = result.group(1) if result else "?"
            out["wakes"][key] = out["wakes"].get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Watcher(threading.Thread):
    """Polls the worker's last ACK and the operator's metrics (``--poll`` s) into series."""

    def __init__(self, cp: Any, ns: str, metrics_port: int, period: float) -> None:
        super().__init__(daemon=True)
        self.cp, self.ns, self.port, self.period = cp, ns, metrics_port, period
        self.acks: dict[str, Any] = {}  # task id -> AckFacts, in the order first seen
        self.metrics: list[Json] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                rep = worker_report(self.cp, self.ns)
                if rep is not None and rep.last_ack is not None:
                    self.acks.setdefault(rep.last_ack.task_id, rep.last_ack)
                self.metrics.append({"t": time.time(), **scrape(self.port)})
            except Exception as exc:  # a poll lost under load is not a result
                log(f"poll failed: {exc}")
            self.halt.wait(self.period)

    def wake_acks(self) -> list[Any]:
        return [a for a in self.acks.values() if a.op == "wake"]


def nth(items: list[Any], i: int) -> Any:
    return items[i] if len(items) > i else None


def wait(what: str, check: Any, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def ack_json(ack: Any) -> Json:
    keys = ("task_id", "ok", "op", "level", "error", "used_before_bytes", "used_after_bytes",
            "free_before_bytes", "free_after_bytes", "needed_bytes", "started_at", "finished_at",
            "duration_s", "bytes_moved")  # fmt: skip
    out = {k: getattr(ack, k) for k in keys}
    out["state"] = ack.state.value
    return out


def scenario(cp: Any, ns: str, op: Operator, tenant: Any, args: argparse.Namespace) -> Json:
    """Steps 2-4: arm, patch Active, let the room come and go, then leave for good."""
    out: Json = {}
    watcher = Watcher(cp, ns, op.metrics, args.poll)
    watcher.start()
    try:
        tenant.arm()
        t0 = time.time()
        cp.kubectl("patch", "omnistage", STAGE, "-n", ns, "--type=merge",
                   "-p", json.dumps({"spec": {"state": "Active"}}))  # fmt: skip
        out["patched_at"] = t0
        tenant_bytes = []
        for i in range(args.flaps):
            ack = wait(f"failed wake {i + 1}", lambda i=i: nth(watcher.wake_acks(), i), 120)
            tenant_bytes.append(tenant.took())
            if i == 0:
                out["first_oom"] = first_oom(cp, ns, ack)
            tenant.release()
            if i < args.flaps - 1:
                tenant.arm()
        left = time.time()
        log("the tenant left for good")
        wait("llm Active", lambda: stage_status(cp, ns, STAGE).get("state") == "Active", 120)
        out["active_after_tenant_left_s"] = round(time.time() - left, 3)
        time.sleep(2 * args.poll + 0.5)  # the last ACK and metrics polled
        out["tenant_bytes"] = tenant_bytes
    finally:
        watcher.halt.set()
        watcher.join(10)
    acks = watcher.wake_acks()
    out["wake_acks"] = [ack_json(a) for a in acks]
    out["worker_wakeups"] = [round(t - t0, 3) for t in tenant.wakes()]
    starts = [a.started_at for a in acks]
    out["wake_started_s"] = [round(t - t0, 3) for t in starts]
    out["gaps_s"] = [round(b - a, 3) for a, b in itertools.pairwise(starts)]
    series = watcher.metrics
    if series:
        out["rounds_in_window"] = series[-1]["rounds"] - series[0]["rounds"]
        out["operator_wakes"] = series[-1]["wakes"]
        step = max(1, len(series) // 60)
        out["metrics_series"] = [
            {"t": round(m["t"] - t0, 2), "rounds": m["rounds"], "wakes": m["wakes"]}
            for m in series[::step]
        ]
    final = stage_status(cp, ns, STAGE)
    keys = ("state", "conditions", "wakeBackoff", "learnedNeedBytes")
    out["final_status"] = {k: final.get(k) for k in keys}
    out["checks"] = checks(out, acks, args)
    out["ok"] = all(out["checks"].values())
    return out


def first_oom(cp: Any, ns: str, ack: Any) -> Json:
    """The stage's status and Events after the first wake out of memory."""

    def ready_oom() -> Json | None:
        st = stage_status(cp, ns, STAGE)
        ready: Json = next((c for c in st.get("conditions") or () if c.get("type") == "Ready"), {})
        return st if ready.get("reason") == "WakeOutOfMemory" else None

    st = wait("Ready WakeOutOfMemory", ready_oom, 60)
    events: list[Json] = wait("the WakeOutOfMemory Event", lambda: [
        e for e in cp.get_json("events", namespace=ns).get("items", [])
        if e.get("reason") == "WakeOutOfMemory" and e["involvedObject"].get("name") == STAGE
    ], 30)  # fmt: skip
    ready: Json = next(c for c in st["conditions"] if c.get("type") == "Ready")
    return {
        "ack": ack_json(ack),
        "ready": ready,
        "wakeBackoff": st.get("wakeBackoff"),
        "learnedNeedBytes": st.get("learnedNeedBytes"),
        "events": [{"type": e.get("type"), "message": e.get("message")} for e in events],
    }


def checks(out: Json, acks: list[Any], args: argparse.Namespace) -> dict[str, bool]:
    first = out["first_oom"]
    ack = acks[0]
    needed = ack.needed_bytes
    gaps = out["gaps_s"]
    # the back-off after the k-th wake out of memory in a row: 1, 2, 4, ... s (at most 30)
    schedule = [min(30.0, 2.0**k) for k in range(len(gaps))]
    wakeups = out["worker_wakeups"]
    return {
        "oom_ack_not_ok_out_of_memory": not ack.ok and "out of memory" in ack.error.lower(),
        "oom_ack_back_asleep_level_1": ack.state.value == "Asleep" and ack.level == 1,
        "oom_ack_nothing_left": ack.used_after_bytes <= ack.used_before_bytes + 2 * MiB,
        "oom_ack_needed_bytes": needed > 0,
        "ready_false_wake_out_of_memory": first["ready"]["status"] == "False"
        and f"needed {needed} bytes more" in first["ready"]["message"],
        "warning_event": any(
            e["type"] == "Warning" and "needed" in e["message"] for e in first["events"]
        ),
        "learned_need_covers_it": (first["learnedNeedBytes"] or 0) >= needed,
        "every_flap_ran_out": len(acks) == args.flaps + 1
        and all(not a.ok and a.needed_bytes > 0 for a in acks[:-1]),
        "gaps_follow_backoff": len(gaps) == args.flaps
        and all(g >= s * 0.95 for g, s in zip(gaps, schedule, strict=True)),
        "fewer_wakes_than_rounds": len(acks) < out.get("rounds_in_window", 0),
        "worker_got_only_these_wakeups": not wakeups or len(wakeups) == len(acks),
        "active_after_tenant_left": acks[-1].ok and out["final_status"]["state"] == "Active",
    }


def run(args: argparse.Namespace) -> Json:
    from tests.cluster.build import binaries_in, find_binaries

    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    report: Json = {"benchmark": "gpu_wake_oom_operator",
                    "command": shlex.join(["python3", *sys.argv]),
                    "date": datetime.now(UTC).isoformat(timespec="seconds")}  # fmt: skip
    commit = ROOT / "COMMIT"
    report["code"] = commit.read_text().strip() if commit.exists() else None
    if args.tiny:
        binaries, report["bundle"] = find_binaries(), None
    else:
        report["bundle"] = unpack_bundle(args.bundle, work)
        binaries = binaries_in(work / "bin")
    report["versions"] = versions()
    devices = [] if args.tiny else nvml_devices()
    report["devices"] = devices
    start = time.monotonic()
    weights = build_model(work, args.layers, args.tiny)
    report["weight_bytes"], report["build_s"] = weights, round(time.monotonic() - start, 1)
    log(f"model: {weights} bytes in {report['build_s']}s")
    tenant_dir = work / "tenant"
    if not args.tiny:
        worker_shim(work, tenant_dir)
    from tests.cluster.controlplane import ControlPlane  # its packages: the bundle's

    crd = ROOT / "crds" / "omnistages.omnistage.io.yaml"
    with ControlPlane(binaries=binaries, controller_manager=False) as cp:
        cp.kubectl("apply", "--server-side", "-f", str(crd))
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("oom")
        os.environ["KUBECONFIG"] = str(cp.kubeconfig)
        gpu_memory = devices[0]["total_bytes"] if devices else 4 * weights
        nodes, report["localnode_mode"] = start_localnode(
            cp.kubeconfig, 1, gpu_memory, not args.tiny, work / "localnode"
        )
        with nodes:
            extra = ("--wake-margin-bytes", "16384") if args.tiny else ()
            op = Operator(cp.kubeconfig, ns, work, extra)
            tenant: Any = None
            try:
                op.wait_healthy()
                manifest = stage_manifest(STAGE, work / "llm", nodes.node_names[0], "Asleep",
                                          "cpu" if args.tiny else "cuda")  # fmt: skip
                cp.apply(manifest, namespace=ns)
                start = time.monotonic()
                wait_states(cp, ns, {STAGE: "Asleep"}, args.settle_timeout)
                report["settle_s"] = round(time.monotonic() - start, 1)
                rep = wait("the worker's report", lambda: worker_report(cp, ns), 60)
                report["asleep"] = {"used_bytes": rep.used_bytes, "free_bytes": rep.free_bytes,
                                    "weights_bytes": rep.weights_bytes}  # fmt: skip
                leave = rep.weights_bytes // 2  # half of the weights fit
                if args.tiny:
                    tenant = SimTenant(nodes.fake_gpu(nodes.node_names[0], "gpu-0"), leave)
                else:
                    tenant = GpuTenant(tenant_dir, leave)
                report["tenant_leaves_bytes"] = leave
                report.update(scenario(cp, ns, op, tenant, args))
            except BaseException:
                log("FAILED; operator log tail:\n" + op.tail(120))
                raise
            finally:
                if tenant is not None:
                    tenant.stop()
                op.stop()
                if args.logs:
                    args.logs.mkdir(parents=True, exist_ok=True)
                    (args.logs / "operator.log").write_text(op.tail(400))
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT.parent / ".gpubundle")
    p.add_argument("--work", type=Path, default=Path("/tmp/oom-operator"))
    p.add_argument("--out", type=Path)
    p.add_argument("--logs", type=Path, help="write the operator's log tail here")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--flaps", type=int, default=4, help="wakes that run out of memory in a row")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between polls")
    p.add_argument("--settle-timeout", type=float, default=300)
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal, simulated GPU")
    args = p.parse_args(argv)
    report = run(args)
    from bench.reporting import emit

    emit(report, args.out)
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    raise SystemExit(main())
