# ruff: noqa: ASYNC220, ASYNC240  (a sequential script: blocking file and process calls are fine)
"""GPU smoke run of the worker (not collected by pytest; run on the lent GPU machine).

Two real workers share one CUDA device, as two stages of a colocation group would:
A (in-process, a ~0.8 GB bf16 Llama) starts active; B (a subprocess, the same model, its GPU
named by UUID in CUDA_VISIBLE_DEVICES) starts asleep at level 1. The run checks NVML's
process-scoped figures in the Acks, the residual bound, bit-identical outputs after sleep/wake at
both levels, and a tiny diffusion pipeline's bit-identical PNG on CUDA. Results go to
``$OUT/gpu_smoke.json``.

    python3 -m tests.worker.gpu_smoke
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from omnistage.worker.v1 import (
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)
from omnistage_worker.config import DeviceSpec, WorkerConfig
from omnistage_worker.serving.server import WorkerServer
from tests.worker.tiny_models import build_causal_lm, build_diffusion_pipeline

MIB = 1024 * 1024


class Client:
    def __init__(self, port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
        self.sleep_stub = sleep_service_pb2_grpc.SleepServiceStub(self.channel)
        self.infer = inference_service_pb2_grpc.InferenceServiceStub(self.channel)
        self.n = 0

    async def status(self) -> Any:
        return await self.sleep_stub.GetStatus(sleep_service_pb2.GetStatusRequest())

    async def sleep(self, level: int) -> Any:
        self.n += 1
        r = await self.sleep_stub.Sleep(
            sleep_service_pb2.SleepRequest(task_id=f"s{self.n}", level=level)  # type: ignore[arg-type]
        )
        return r.ack

    async def wake(self) -> Any:
        self.n += 1
        r = await self.sleep_stub.WakeUp(sleep_service_pb2.WakeUpRequest(task_id=f"w{self.n}"))
        return r.ack

    async def generate(self, **kw: Any) -> Any:
        return await self.infer.Generate(inference_service_pb2.GenerateRequest(**kw))


def brief(ack: Any) -> dict[str, Any]:
    d = MessageToDict(ack, preserving_proto_field_name=True)
    d.pop("worker", None)
    return d


async def main() -> int:
    out = Path(os.environ.get("OUT", "/tmp/out"))
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp())
    results: dict[str, Any] = {"checks": {}}
    checks: dict[str, bool] = results["checks"]
    t0 = time.monotonic()
    lm = build_causal_lm(work / "lm", hidden_size=2048, intermediate_size=5632, num_hidden_layers=8)
    sd = build_diffusion_pipeline(work / "sd")
    results["build_s"] = round(time.monotonic() - t0, 2)

    import torch

    uuid = "GPU-" + str(torch.cuda.get_device_properties(0).uuid)
    results["gpu_uuid"] = uuid

    # --- A: in-process, active, bf16 --------------------------------------------------------
    a_cfg = WorkerConfig(
        runner="ar",
        backend="transformers",
        model=lm,
        host="127.0.0.1",
        port=0,
        device=DeviceSpec("cuda", 0),
        dtype="bfloat16",
    )
    a_srv = WorkerServer(a_cfg)
    a = Client(await a_srv.start())
    await a_srv.wait_loaded()
    st = await a.status()
    results["a_status_active"] = brief(st)
    results["a_baseline_bytes"] = a_srv.worker.baseline
    ref = list((await a.generate(prompt="the cat sat", max_new_tokens=16)).text.token_ids)

    # --- B: subprocess, asleep at level 1, GPU named by UUID ---------------------------------
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": uuid, "PYTHONUNBUFFERED": "1"}
    log = (work / "b.log").open("w")
    b_proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "omnistage_worker",
            "--runner",
            "ar",
            "--backend",
            "transformers",
            "--model",
            str(lm),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--initial-state",
            "asleep",
            "--sleep-level",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    port = 0
    for _ in range(600):
        m = re.search(r"listening on [\d.]+:(\d+)", (work / "b.log").read_text())
        if m:
            port = int(m.group(1))
            break
        await asyncio.sleep(0.1)
    b = Client(port)
    for _ in range(1200):
        try:
            if (await b.status()).state == types_pb2.WORKER_STATE_ASLEEP:
                break
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.1)
    b_st = await b.status()
    results["b_status_asleep"] = brief(b_st)
    checks["b_asleep_uses_only_context"] = b_st.used_bytes <= 1024 * MIB

    # Hand-over: A sleeps at 1, B wakes; then B sleeps at 2, A wakes; repeat with levels swapped.
    acks: list[dict[str, Any]] = []
    for level in (1, 2, 1):
        s = await a.sleep(level)
        acks.append({"who": "A", **brief(s)})
        checks[f"a_sleep{level}_ok"] = s.ok and s.used_after_bytes <= s.residual_bound_bytes
        w = await b.wake()
        acks.append({"who": "B", **brief(w)})
        checks[f"b_wake_after_a_sleep{level}_ok"] = w.ok
        out_b = list((await b.generate(prompt="the cat sat", max_new_tokens=16)).text.token_ids)
        checks[f"b_output_equals_a_reference_{level}"] = out_b == ref
        s2 = await b.sleep(3 - level)
        acks.append({"who": "B", **brief(s2)})
        checks[f"b_sleep{3 - level}_ok"] = s2.ok
        w2 = await a.wake()
        acks.append({"who": "A", **brief(w2)})
        checks[f"a_wake_from{level}_ok"] = w2.ok
        out_a = list((await a.generate(prompt="the cat sat", max_new_tokens=16)).text.token_ids)
        checks[f"a_bit_identical_after_level{level}"] = out_a == ref
    results["acks"] = acks
    results["a_status_end"] = brief(await a.status())
    b_proc.terminate()
    results["b_exit"] = b_proc.wait(60)
    results["b_log_tail"] = (work / "b.log").read_text()[-3000:]
    await a_srv.stop(1)

    # --- a tiny diffusion pipeline: bit-identical PNG after sleep/wake on CUDA --------------
    import gc

    del a_srv
    gc.collect()
    torch.cuda.empty_cache()
    d_srv = WorkerServer(
        WorkerConfig(
            runner="diffusion",
            backend="diffusers",
            model=sd,
            host="127.0.0.1",
            port=0,
            device=DeviceSpec("cuda", 0),
        )
    )
    d = Client(await d_srv.start())
    await d_srv.wait_loaded()
    png = (await d.generate(prompt="a cat", seed=5, num_inference_steps=4)).image.png
    for level in (1, 2):
        s = await d.sleep(level)
        w = await d.wake()
        again = (await d.generate(prompt="a cat", seed=5, num_inference_steps=4)).image.png
        checks[f"diffusion_level{level}_ok"] = s.ok and w.ok
        checks[f"diffusion_bit_identical_level{level}"] = again == png
        results[f"diffusion_sleep{level}"] = brief(s)
    await d_srv.stop(1)

    # A container with its own PID namespace: NVML does not know our pid. Pretend so, and
    # check that the probe recognises this process by the growth of a probe allocation.
    from omnistage_worker import memory

    probe = memory.NvmlProbe(0, pid=999_999_999)
    probe.resolve_pid(memory.cuda_allocator(0))
    checks["nvml_pid_recognised_by_growth"] = probe.pid == os.getpid()
    results["nvml_processes"] = probe.processes()

    results["all_ok"] = all(checks.values())
    (out / "gpu_smoke.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(checks, indent=1))
    print("ALL OK" if results["all_ok"] else "SOME CHECKS FAILED")
    return 0 if results["all_ok"] else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
