"""One run of ``bench/pipeline.py``: the two stages and the OmniPipeline in their own namespace,
localnode, the operator and ``omnistage-router``, then ``--clients`` closed-loop image clients;
images/s, swaps and batches from the pipeline's status, and the first answers kept."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import gpu_e2e_cluster
from bench.gpu_e2e_analysis import GiB

Json = dict[str, Any]
PROMPTS = ["the cat sat on the mat", "a dog ran in the park", "a bird can fly over the tree"]
TINY_ROOM = 5_000_000  # simulated GPU with room for one tiny stage (as tests/e2e/test_pipeline)
TINY_VRAM = "3500k"


def log(msg: str) -> None:
    print(f"[pipeline {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def stage(name: str, model: Path, node: str, tiny: bool, max_batch: int) -> Json:
    """An OnDemand stage of group ``qwen``, asleep at level 1 (``max_batch``: its worker's)."""
    runner, backend = ("AR", "Transformers") if name == "encoder" else ("Diffusion", "Diffusers")
    worker: Json = {"device": "cpu" if tiny else "cuda"}
    if not tiny:
        worker["dtype"] = "bfloat16"
    spec: Json = {
        "runner": runner, "backend": backend, "image": "omnistage/worker:bench",
        "model": {"path": "/models/m", "mountPath": "/models/m",
                  "volume": {"hostPath": {"path": str(model), "type": "Directory"}}},
        "state": "Asleep", "sleepLevel": 1,
        "activation": {"policy": "OnDemand", "holdTimeout": "300s"},
        "colocation": {"group": "qwen", "priority": 0}, "gpus": 1, "worker": worker,
        "template": {"nodeSelector": {"kubernetes.io/hostname": node}},
        "limits": {"maxBatch": max_batch},
    }  # fmt: skip
    if tiny:
        spec["vram"] = {"request": TINY_VRAM}
    return {"apiVersion": "omnistage.io/v1alpha1", "kind": "OmniStage",
            "metadata": {"name": name}, "spec": spec}  # fmt: skip


def pipeline(max_batch: int, max_wait: str) -> Json:
    return {
        "apiVersion": "omnistage.io/v1alpha1", "kind": "OmniPipeline",
        "metadata": {"name": "qwen-image"},
        "spec": {"stages": [{"name": "encoder", "passes": "Embeds"}, {"name": "dit"}],
                 "batching": {"maxBatch": max_batch, "maxWait": max_wait}},
    }  # fmt: skip


async def drive(base: str, args: argparse.Namespace, serial: bool) -> tuple[float, list[Json]]:
    """``--clients`` clients of ``--requests`` each; seconds taken and every answer."""
    import httpx

    gate = asyncio.Semaphore(1 if serial else args.clients)
    answers: list[Json] = []

    async def client(c: int, http: httpx.AsyncClient) -> None:
        for r in range(args.requests):
            body = {"model": "qwen-image", "prompt": PROMPTS[(c + r) % len(PROMPTS)],
                    "seed": c * 1000 + r, "size": f"{args.size}x{args.size}",
                    "num_inference_steps": args.steps}  # fmt: skip
            async with gate:
                reply = await http.post(f"{base}/v1/images/generations", json=body)
            if reply.status_code != 200:
                raise RuntimeError(f"request {c}/{r}: {reply.status_code} {reply.text[:500]}")
            answers.append({**body, "b64": reply.json()["data"][0]["b64_json"]})

    async with httpx.AsyncClient(timeout=3600) as http:
        start = time.monotonic()
        await asyncio.gather(*(client(c, http) for c in range(args.clients)))
        return time.monotonic() - start, answers


def one_run(cp: Any, kind: str, args: argparse.Namespace, models: Path, work: Path) -> Json:
    """One of the three runs in its own namespace, localnode, operator and router."""
    import httpx

    from tests.cluster.procs import free_port, terminate, wait_for

    ns = cp.create_namespace(f"pipe-{kind.replace('_', '-')}")
    room = None if kind == "resident" else TINY_ROOM
    memory = (room or 80 * GiB) if args.tiny else 0
    nodes, mode = gpu_e2e_cluster.start_localnode(
        cp.kubeconfig, 1, memory or args.device_bytes, not args.tiny, work / f"ln-{kind}"
    )
    out: Json = {"run": kind, "localnode": mode}
    op = router = None
    with nodes:
        try:
            extra = ("--wake-margin-bytes", "16384") if args.tiny else ()
            op = gpu_e2e_cluster.Operator(cp.kubeconfig, ns, work, extra)
            op.wait_healthy()
            node = nodes.node_names[0]
            serial = kind == "per_request"
            batch, max_wait = (1, "0s") if serial else (args.max_batch, args.max_wait)
            worker_batch = {"encoder": args.max_batch, "dit": args.dit_batch}
            for name in ("encoder", "dit"):
                manifest = stage(name, models / name, node, args.tiny, worker_batch[name])
                cp.apply(manifest, namespace=ns)
            cp.apply(pipeline(batch, max_wait), namespace=ns)

            def asleep() -> bool:
                states = [cp.get_json("omnistage", n, namespace=ns).get("status", {}).get("state")
                          for n in ("encoder", "dit")]  # fmt: skip
                return states == ["Asleep", "Asleep"]

            try:
                wait_for("both stages loaded and asleep", asleep, 900, 0.25)
            except Exception:
                diag = cp.kubectl("get", "pods,resourceclaims,events", "-o", "wide", "-n", ns,
                                  check=False)  # fmt: skip
                (work / f"stuck-{kind}.txt").write_text(f"{diag.stdout}\n{diag.stderr}")
                raise
            targets = {}
            for name in ("encoder", "dit"):
                pod = cp.get_json("pod", f"{name}-worker", namespace=ns)
                port = pod["spec"]["containers"][0]["ports"][0]["containerPort"]
                targets[name] = f"{pod['status']['podIP']}:{port}"
            port = free_port()
            router_log = (work / f"router-{kind}.log").open("ab")
            router = subprocess.Popen(
                [sys.executable, "-m", "omnistage_worker.serving.router", "--host", "127.0.0.1",
                 "--port", str(port), "--pipeline", "qwen-image=encoder:embeds,dit",
                 *[f"--grpc-route={k}={v}" for k, v in targets.items()]],
                stdout=router_log, stderr=subprocess.STDOUT,
            )  # fmt: skip
            base = f"http://127.0.0.1:{port}"
            wait_for("router", lambda: httpx.get(f"{base}/health", timeout=1).is_success, 60)
            warm = argparse.Namespace(**{**vars(args), "clients": 1, "requests": 1})
            asyncio.run(drive(base, warm, serial))  # both stages woken once, outside the timing

            def counters() -> tuple[int, int]:
                got = cp.get_json("omnipipeline", "qwen-image", namespace=ns).get("status", {})
                return int(got.get("swaps") or 0), int(got.get("batches") or 0)

            time.sleep(2.0)  # the warm-up's last round written to status
            before = counters()
            began = time.time()
            timed = args
            if serial and args.per_request_requests:
                timed = argparse.Namespace(**{**vars(args), "requests": args.per_request_requests})
            seconds, answers = asyncio.run(drive(base, timed, serial))
            ended = time.time()
            time.sleep(2.0)
            after = counters()
            out.update({
                "seconds": round(seconds, 3), "images": len(answers),
                "images_per_s": round(len(answers) / seconds, 4),
                "swaps": after[0] - before[0], "batches": after[1] - before[1],
                "policy": {"maxBatch": batch, "maxWait": max_wait, "serial": serial},
                "window": [began, ended], "dit_worker_batch": args.dit_batch,
            })  # fmt: skip
            out["answers"] = answers[: args.check]
            log(f"{kind}: {out['images_per_s']} images/s, swaps {out['swaps']}")
        finally:
            if router is not None:
                terminate(router)
            if op is not None:
                op.stop()
    return out
