"""The cluster side of ``bench/gpu_e2e.py`` (and of the benches that share it): localnode on the
host's GPUs, the operator as a process, the two stages' manifests and status, one hand-over by
``kubectl patch`` timed to the Active status, and a Generate on a stage."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

Json = dict[str, Any]


TOKEN = "gpu-e2e-worker-token"


def start_localnode(
    kubeconfig: Path, gpus: int, gpu_memory: int, real: bool, state: Path
) -> tuple[Any, str]:
    """localnode for one node: the host's GPUs from NVML (``--real-gpus``), else simulated."""
    from tests.cluster.localnode import LocalNodes

    nodes = LocalNodes(
        kubeconfig, nodes=1, gpus=gpus, gpu_memory=gpu_memory, name_prefix="gpu-host-",
        state_dir=state, real_gpus=real,
    )  # fmt: skip
    return nodes, "localnode --real-gpus" if real else "localnode, simulated GPU"


class Operator:
    """``python -m omnistage_operator.cli`` with the admin kubeconfig."""

    def __init__(
        self, kubeconfig: Path, namespace: str, work: Path, extra: tuple[str, ...] = ()
    ) -> None:
        from tests.cluster.procs import free_port

        token = work / "token"
        token.write_text(TOKEN)
        self.liveness = free_port()
        self.metrics = free_port()
        self.log = work / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "omnistage_operator.cli", "--namespace", namespace,
                "--worker-token-file", str(token), "--metrics-port", str(self.metrics),
                "--liveness-port", str(self.liveness), *extra]  # fmt: skip
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 90) -> float:
        import urllib.request

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
            try:
                url = f"http://127.0.0.1:{self.liveness}/healthz"
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"operator not healthy in {timeout}s:\n{self.tail()}")

    def stop(self) -> None:
        from tests.cluster.procs import terminate

        terminate(self.proc)

    def tail(self, n: int = 80) -> str:
        from tests.cluster.procs import tail_log

        return tail_log(self.log, n)


def stage_manifest(name: str, model: Path, node: str, state: str, device: str) -> Json:
    runner, backend = ("AR", "Transformers") if name == "llm" else ("Diffusion", "Diffusers")
    worker: Json = {"device": device}
    if device == "cuda":
        worker["dtype"] = "bfloat16"
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "runner": runner,
            "backend": backend,
            "image": "omnistage/worker:gpu-e2e",
            "model": {
                "path": "/models/m",
                "mountPath": "/models/m",
                "volume": {"hostPath": {"path": str(model), "type": "Directory"}},
            },
            "state": state,
            "sleepLevel": 1,
            "colocation": {"group": "gpu0", "priority": 0},
            "gpus": 1,
            "worker": worker,
            "template": {"nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }


def stage_status(cp: Any, ns: str, name: str) -> Json:
    obj = cp.get_json("omnistage", name, namespace=ns)
    return dict(obj.get("status") or {})


def wait_states(cp: Any, ns: str, want: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        seen = {n: stage_status(cp, ns, n).get("state") for n in want}
        if seen == want:
            return
        time.sleep(0.25)
    raise TimeoutError(f"stages not {want} after {timeout}s: {seen}")


def generate(cp: Any, ns: str, stage: str, tiny: bool) -> float:
    """One Generate on ``stage``'s worker (dialled at its pod IP); returns seconds."""
    import grpc

    from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc

    pod = cp.get_json("pod", f"{stage}-worker", namespace=ns)
    port = next(
        (p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])), 50051
    )
    req = inference_service_pb2.GenerateRequest(
        request_id=f"g-{time.time_ns()}", prompt="the cat sat on the mat", seed=1
    )
    if stage == "llm":
        req.max_new_tokens = 16
    else:
        req.num_inference_steps = 2
        req.height = req.width = 64 if tiny else 512
    start = time.monotonic()
    with grpc.insecure_channel(f"{pod['status']['podIP']}:{port}") as ch:
        inference_service_pb2_grpc.InferenceServiceStub(ch).Generate(req, timeout=120)
    return time.monotonic() - start


def hand_over(cp: Any, ns: str, state: str) -> Json:
    """Patch sd's wish with kubectl; time it until the gainer's status reads Active."""
    import asyncio

    from bench.operator_switch import _wait_active
    from omnistage_operator.k8s.kube import OMNISTAGE, Kube

    gainer, loser = ("sd", "llm") if state == "Active" else ("llm", "sd")

    async def run() -> Json:
        kube = await Kube.connect()
        current = await kube.get(OMNISTAGE, ns, gainer)
        assert current is not None
        waiter = asyncio.create_task(
            _wait_active(kube, ns, gainer, current["metadata"]["resourceVersion"], 300)
        )
        await asyncio.sleep(0.05)  # the watch connects before the patch
        wall0, t0 = time.time(), time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            str(cp.binaries.kubectl), f"--kubeconfig={cp.kubeconfig}", "-v=6", "patch", "omnistage",
            "sd", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"state": state}}),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        t_kubectl = time.monotonic()
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl patch failed: {err.decode()}")
        t1 = await waiter
        return {"gainer": gainer, "loser": loser, "wall_start": wall0,
                "total_s": t1 - t0, "kubectl_s": t_kubectl - t0,
                "patch_request_s": patch_latency_s(err.decode(errors="replace"))}  # fmt: skip

    r = asyncio.run(run())
    gain, lose = stage_status(cp, ns, gainer), stage_status(cp, ns, loser)
    r["wake"], r["sleep"] = gain.get("lastAck") or {}, lose.get("lastAck") or {}
    r["gainer_memory"], r["loser_memory"] = gain.get("memory") or {}, lose.get("memory") or {}
    wake, sleep = r["wake"], r["sleep"]
    r["acks_ok"] = bool(
        wake.get("op") == "wake"
        and wake.get("ok")
        and sleep.get("op") == "sleep"
        and sleep.get("ok")
    )
    worker = workers_s(sleep, wake)
    r["worker_s"] = worker
    r["operator_s"] = r["total_s"] - worker
    r.update(operator_shares(r))
    return r


def workers_s(sleep: Json, wake: Json) -> float:
    """The workers' share of a hand-over: the sleep's and the wake's transitions one after the
    other, or, when the wake began before the sleep ended (an overlapped hand-over), the span
    from the first start to the last end (their clocks are one host's)."""
    serial = float(sleep.get("durationSeconds") or 0) + float(wake.get("durationSeconds") or 0)
    marks = [sleep.get("startedAt"), sleep.get("time"), wake.get("startedAt"), wake.get("time")]
    if not all(marks):
        return serial
    s0, s1, w0, w1 = (datetime.fromisoformat(str(m).replace("Z", "+00:00")) for m in marks)
    if w0 >= s1:
        return serial
    return (max(s1, w1) - min(s0, w0)).total_seconds()


_PATCH_LATENCY = (
    re.compile(r'verb="PATCH".*?milliseconds=(\d+)'),  # klog's structured form
    re.compile(r"PATCH \S+ \d{3}[^\n]*? in (\d+) milliseconds"),  # the older plain form
)


def patch_latency_s(log: str) -> float | None:
    """The PATCH's round trip as ``kubectl -v=6`` logs it (None: no such line)."""
    for pattern in _PATCH_LATENCY:
        found = pattern.search(log)
        if found:
            return int(found.group(1)) / 1000
    return None


def operator_shares(run: Json) -> Json:
    """A hand-over's time that is neither the workers' transitions nor kubectl's own process:
    ``operator_from_answer_s`` from kubectl's exit (its PATCH answered) to Active, and, where
    kubectl logged its PATCH's round trip, ``operator_from_patch_s`` from the PATCH sent
    (kubectl's start-up and exit subtracted, its request kept: the API server's write counts)."""
    rest = run["total_s"] - run["worker_s"]
    out: Json = {"operator_from_answer_s": rest - run["kubectl_s"]}
    request = run.get("patch_request_s")
    if request is not None:
        out["operator_from_patch_s"] = rest - (run["kubectl_s"] - request)
    return out
