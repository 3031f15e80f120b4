"""A wake that runs out of device memory on the real GPU: back asleep, nothing left, figures right.

Run on the lent GPU machine from a copy of the repository, with the site packages of the bundle
that ``python -m bench.gpu_bundle`` built (only ``site.tar.xz`` is needed)::

    python3 bench/gpu_wake_oom.py --site ../.gpubundle/site.tar.xz --out $OUT/gpu_wake_oom.json

What it does:

1. builds, on the GPU, a Llama-style causal LM with random bf16 weights from a config
   (``--layers`` of the 16.6 GiB model's 36; default 18: about 8.6 GiB), saved in ``--work``;
2. starts the real ``omnistage-worker`` process on ``cuda:0`` (Active), one Generate, then a
   level-1 Sleep;
3. the gate: reads the device's free memory (NVML) and checks the wake fits; then a tenant
   process takes the room (it leaves ``--leave`` of the weights free, default half), as another
   process would between an operator's gate and the copy;
4. WakeUp: the ACK must be not ok, the worker back ASLEEP at level 1, its own NVML figure
   (and an outside NVML reading of its pid) back to its context, ``needed_bytes`` equal to the
   wake's allocation (PyTorch's "Tried to allocate", printed to 0.01 GiB) less the free memory
   an outside NVML reading shows after it (within 16 MiB);
5. the tenant leaves; WakeUp again must be ok, and the next Generate must give the same tokens
   as before the sleep (the weights were still in host memory).

``--tiny`` runs the same flow on a machine without a GPU: a tiny model on CPU, on the test
harness's simulated GPU, whose ``tenant_on_copy`` fault plays the tenant (to test the script).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC_PATHS = [
    ROOT / "operator" / "src",
    ROOT / "worker_image" / "src",
    ROOT / "protos" / "gen" / "python",
    ROOT,
]
Json = dict[str, Any]
MiB = 1 << 20
GiB = 1 << 30


def log(msg: str) -> None:
    print(f"[gpu_wake_oom {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def setup_paths(site: Path | None, work: Path) -> None:
    """Unpack the site packages (once) and put them and the tree first on the paths."""
    paths = [str(p) for p in SRC_PATHS]
    if site is not None:
        dest = work / "site"
        if not (dest / ".installed").is_file():
            dest.mkdir(parents=True, exist_ok=True)
            with lzma.open(site) as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
                tar.extractall(dest, filter="data")
            (dest / ".installed").write_text("")
        paths.insert(0, str(dest))
    for p in reversed(paths):
        sys.path.insert(0, p)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, [os.environ.get("PYTHONPATH")])]
    )


def build_model(directory: Path, layers: int, tiny: bool) -> int:
    """The LM (tokenizer from the tests' tiny model, weights from a config); its weight bytes."""
    import torch

    from bench.sleep_models import llm_config
    from tests.worker.tiny_models import build_causal_lm

    done = directory / f".done-{layers}-{int(tiny)}"
    if not done.exists():
        build_causal_lm(directory)
        if not tiny:
            from transformers import LlamaForCausalLM

            for f in directory.glob("*.safetensors"):
                f.unlink()
            config = llm_config(False)
            config.num_hidden_layers = layers
            torch.set_default_dtype(torch.bfloat16)
            torch.manual_seed(0)
            with torch.device("cuda:0"):
                model = LlamaForCausalLM(config)
            model.save_pretrained(directory, max_shard_size="4GB")
            del model
            torch.set_default_dtype(torch.float32)
            torch.cuda.empty_cache()
        done.write_text("")
    return sum(f.stat().st_size for f in directory.glob("*.safetensors"))


class Nvml:
    """The outside view: the device's free memory and one pid's used memory."""

    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nvml = pynvml
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)

    def free(self) -> int:
        return int(self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free)

    def used_by(self, pid: int) -> int:
        procs = self.nvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        return sum(int(p.usedGpuMemory or 0) for p in procs if int(p.pid) == pid)


def child_tenant(nbytes: int, ready: str) -> None:
    """Another process on the device: takes ``nbytes`` and keeps them until SIGTERM."""
    import torch

    block = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    block.fill_(1)
    torch.cuda.synchronize()
    Path(ready).write_text(str(nbytes))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    del block


class Worker:
    """The real worker process, driven over gRPC."""

    def __init__(self, model: Path, work: Path, tiny: bool, gpu_dir: Path | None) -> None:
        import grpc

        from omnistage.worker.v1 import inference_service_pb2_grpc, sleep_service_pb2_grpc

        env = dict(os.environ, PYTHONUNBUFFERED="1")
        device = "cpu" if tiny else "cuda"
        if gpu_dir is not None:
            env.update(
                OMNISTAGE_MEMORY_PROBE="tests.fakegpu.probe:from_env",
                OMNISTAGE_FAKE_GPU=str(gpu_dir),
            )
        self.argv = [
            sys.executable, "-m", "omnistage_worker", "--runner", "ar", "--backend", "transformers",
            "--model", str(model), "--device", device, "--host", "127.0.0.1", "--port", "0",
        ]  # fmt: skip
        self.log_path = work / "worker.log"
        self._fh = self.log_path.open("w")
        self.proc = subprocess.Popen(self.argv, stdout=self._fh, stderr=subprocess.STDOUT, env=env)
        port = self._wait(self._port, 300, "the worker to listen")
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.sleep_stub = sleep_service_pb2_grpc.SleepServiceStub(self.channel)
        self.infer = inference_service_pb2_grpc.InferenceServiceStub(self.channel)

    def _wait(self, check: Any, timeout: float, what: str) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}:\n{self.log_path.read_text()[-3000:]}")

    def _port(self) -> int | None:
        match = re.search(r"listening on [\d.]+:(\d+)", self.log_path.read_text())
        if match:
            return int(match.group(1))
        if self.proc.poll() is not None:
            raise RuntimeError(f"worker exited:\n{self.log_path.read_text()[-3000:]}")
        return None

    def status(self) -> Any:
        from omnistage.worker.v1 import sleep_service_pb2

        return self.sleep_stub.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)

    def wait_state(self, state: int, timeout: float = 300) -> Any:
        return self._wait(
            lambda: self.status() if self.status().state == state else None, timeout, "the state"
        )

    def sleep(self) -> Any:
        from omnistage.worker.v1 import sleep_service_pb2

        req = sleep_service_pb2.SleepRequest(task_id=uuid.uuid4().hex, level=1)  # type: ignore[arg-type]
        return self.sleep_stub.Sleep(req, timeout=300).ack

    def wake(self) -> Any:
        from omnistage.worker.v1 import sleep_service_pb2

        req = sleep_service_pb2.WakeUpRequest(task_id=uuid.uuid4().hex)
        return self.sleep_stub.WakeUp(req, timeout=300).ack

    def generate(self) -> list[int]:
        from omnistage.worker.v1 import inference_service_pb2

        req = inference_service_pb2.GenerateRequest(prompt="the cat", max_new_tokens=8)
        return list(self.infer.Generate(req, timeout=300).text.token_ids)

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self._fh.close()


def ack_json(ack: Any) -> Json:
    from google.protobuf.json_format import MessageToDict

    return MessageToDict(ack, preserving_proto_field_name=True)


def outside(nvml: Nvml | None, gpu: Any, pid: int) -> tuple[int, int]:
    """An outside reading: ``pid``'s used memory and the device's free memory."""
    if nvml is not None:
        return nvml.used_by(pid), nvml.free()
    snap = gpu.snapshot()
    return snap.procs[pid].used, snap.free


def run(args: argparse.Namespace) -> Json:
    from omnistage.worker.v1 import types_pb2

    work: Path = args.work
    out: Json = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "tiny": args.tiny,
    }
    start = time.monotonic()
    out["weight_bytes"] = build_model(work / "llm", args.layers, args.tiny)
    out["build_seconds"] = round(time.monotonic() - start, 1)
    gpu = None
    gpu_dir = None
    if args.tiny:
        from tests.fakegpu.device import FakeGpu
        from tests.fakegpu.model import Device

        gpu_dir = work / "fakegpu"
        gpu = FakeGpu.create(gpu_dir, Device(uuid="GPU-sim", total=64 * MiB, activation=0))
    else:
        import torch

        out["device"] = torch.cuda.get_device_name(0)
        out["torch"] = torch.__version__
    nvml = None if args.tiny else Nvml()
    worker = Worker(work / "llm", work, args.tiny, gpu_dir)
    tenant: subprocess.Popen[bytes] | None = None
    try:
        awake = worker.wait_state(types_pb2.WORKER_STATE_ACTIVE)
        tokens = worker.generate()
        slept = worker.sleep()
        assert slept.ok, slept.error
        asleep = worker.status()
        context = asleep.used_bytes
        flat = awake.used_bytes - context  # the engine's flat buffer, as measured awake
        out["awake_used_bytes"] = awake.used_bytes
        out["asleep_used_bytes"] = context
        # The gate: the wake fits now.
        free_at_gate = outside(nvml, gpu, worker.proc.pid)[1]
        out["free_at_gate_bytes"] = free_at_gate
        assert free_at_gate > flat, (free_at_gate, flat)
        take = free_at_gate - int(flat * args.leave)
        out["tenant_bytes"] = take
        if gpu is not None:
            gpu.set_faults(pid=worker.proc.pid, tenant_on_copy=[os.getpid(), take])
        else:
            ready = work / "tenant.ready"
            ready.unlink(missing_ok=True)
            tenant = subprocess.Popen(
                [sys.executable, __file__, "--child-tenant", str(take), str(ready)]
            )
            worker._wait(ready.exists, 120, "the tenant to take its memory")
        log(f"tenant holds {take / GiB:.2f} GiB; the wake needs {flat / GiB:.2f} GiB")
        t0 = time.monotonic()
        failed = worker.wake()
        out["oom_wake_seconds"] = round(time.monotonic() - t0, 3)
        status = worker.status()
        outside_used, outside_free = outside(nvml, gpu, worker.proc.pid)
        out["oom_ack"] = ack_json(failed)
        # What the wake allocates: the OOM's own "Tried to allocate" (PyTorch prints it to
        # 0.01 GiB) on a GPU; the flat buffer measured awake on the simulated one.
        from omnistage_worker.control.oom import _TRIED, _quantity

        tried = _quantity(_TRIED.search(failed.error))
        allocation = flat if tried is None else tried
        expected_needed = allocation - outside_free
        out["wake_allocation_bytes"] = allocation
        checks = {
            "ack_not_ok": not failed.ok,
            "error_says_out_of_memory": "out of memory" in failed.error.lower(),
            "back_asleep_level_1": failed.state == types_pb2.WORKER_STATE_ASLEEP
            and failed.level == types_pb2.SLEEP_LEVEL_OFFLOAD
            and status.state == types_pb2.WORKER_STATE_ASLEEP,
            "nothing_left_on_device_own_figure": failed.used_after_bytes <= context + 2 * MiB,
            "nothing_left_on_device_outside_nvml": outside_used <= context + 2 * MiB,
            "needed_bytes_right": failed.needed_bytes > 0
            and abs(failed.needed_bytes - expected_needed) <= 16 * MiB,
            "free_after_matches_outside": abs(failed.free_after_bytes - outside_free) <= 64 * MiB,
        }
        out["outside_used_after_bytes"] = outside_used
        out["outside_free_after_bytes"] = outside_free
        out["expected_needed_bytes"] = expected_needed
        if tenant is not None:
            tenant.send_signal(signal.SIGTERM)
            tenant.wait(60)
            tenant = None
        elif gpu is not None:
            gpu.withdraw(os.getpid())
        t0 = time.monotonic()
        woke = worker.wake()
        out["wake_after_tenant_seconds"] = round(time.monotonic() - t0, 3)
        out["wake_ack"] = ack_json(woke)
        checks["wake_after_tenant_ok"] = woke.ok and woke.needed_bytes == 0
        checks["same_tokens_after"] = worker.generate() == tokens
        out["checks"] = checks
        out["ok"] = all(checks.values())
    finally:
        if tenant is not None:
            tenant.kill()
        worker.stop()
        out["worker_log_tail"] = worker.log_path.read_text()[-4000:]
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child-tenant":
        child_tenant(int(argv[1]), argv[2])
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", type=Path, help="site.tar.xz of the GPU bundle")
    p.add_argument("--work", type=Path, default=Path("/tmp/gatehard"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--layers", type=int, default=18)
    p.add_argument("--leave", type=float, default=0.5, help="share of the weights left free")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    setup_paths(args.site, args.work)
    report = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, sort_keys=True))
    print(
        json.dumps(
            {k: v for k, v in report.items() if k != "worker_log_tail"}, indent=2, sort_keys=True
        )
    )
    return 0 if report.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
