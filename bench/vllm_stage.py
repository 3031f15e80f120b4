"""A vLLM stage on the GPU: the real worker (this tree) over gRPC, its own ACKs against the copy
limits measured in the same run, and a hand-over with a torch stage on the same GPU.

Run on the lent GPU machine with vLLM 0.24.0 on PYTHONPATH (see bench/results/vllm_stage.md):

    python bench/vllm_stage.py --workdir /tmp/osbench/vllm --out $OUT/vllm_stage.json

In ONE run it measures the host<->device copy limits (``bench/worker_sleep.py``'s child, same
exact-size registered host buffers), builds a Llama-architecture causal LM of >= 8 GiB from a
config with random bf16 weights (safetensors + config.json, no tokenizer: the worker sends
prompt token ids and vLLM runs with ``skip_tokenizer_init``) and a smaller torch model with a
local tokenizer, then starts the torch worker asleep and the vLLM worker Active (its memory:
``--vllm-fraction`` of the device), and records: the cold start, level-1 and level-2 sleep/wake
cycles through the worker's ACKs (worker-side seconds, NVML figures of the engine's process
tree, residual bound), the device's NVML used memory after each sleep as an outside observer
sees it, Generate refused while asleep, token ids identical after every wake, 1 -> 2 refused
while asleep, and a hand-over vLLM -> torch -> vLLM on the one GPU.

``--smoke`` runs the same code on CPU at a tiny size with the STAND-IN engine (tests/fakevllm)
on a simulated GPU (tests/fakegpu), to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

import grpc  # noqa: E402

from bench.reporting import emit  # noqa: E402
from bench.worker_grpc import (  # noqa: E402
    INFERENCE,
    SLEEP,
    ack_json,
    ensure_tokenizer,
    free_port,
)
from omnistage.worker.v1 import (  # noqa: E402
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)

Json = dict[str, Any]
GiB = 1024**3
MiB = 1024**2
STANDIN = REPO / "tests" / "fakevllm"
PROMPT = "omnistage vllm stage bench prompt"  # UTF-8 bytes are the token ids (no tokenizer)

# A Llama of ~8.4 GiB in bf16 (GQA 32/8 heads): 24 layers of 4096 x 11008, vocab 32000.
LLM_CONFIG: Json = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# ---- models ---------------------------------------------------------------------------------


def llama_shapes(cfg: Json) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of a Llama checkpoint as transformers and vLLM load it."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    shapes |= {"model.norm.weight": (h,), "lm_head.weight": (v, h)}
    return shapes


def write_llama(directory: Path, cfg: Json, shard_bytes: int = 2 * GiB) -> Json:
    """Random bf16 weights (norms: ones) in safetensors shards with an index, and config.json."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=dev).manual_seed(0)
    shards: list[dict[str, Any]] = [{}]
    size = 0
    total = 0
    for name, shape in llama_shapes(cfg).items():
        if name.endswith("norm.weight"):
            t = torch.ones(shape, dtype=torch.bfloat16)
        else:
            t = (torch.randn(shape, generator=gen, device=dev) * 0.02).to(torch.bfloat16).cpu()
        nbytes = t.numel() * t.element_size()
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
        total += nbytes
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards):
        fname = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, fname)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(cfg))
    return {"dir": str(directory), "bytes": total, "shards": len(shards)}


def child_build(workdir: Path, smoke: bool, torch_layers: int) -> Json:
    """The vLLM model (no tokenizer) and the torch model (with a local tokenizer); models
    already built there (a warm machine keeps /tmp) are reused."""
    built = workdir / "built.json"
    if built.exists():
        done: Json = json.loads(built.read_text())
        if done.get("smoke") == smoke and done.get("torch_layers") == torch_layers:
            return done
    if smoke:
        from tests.fakevllm.models import build_standin_model

        llm = build_standin_model(workdir / "vllm_llm", weights=400_000)
        torch_cfg = {**LLM_CONFIG, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 2, "num_attention_heads": 4,
                     "num_key_value_heads": 2, "vocab_size": 256}  # fmt: skip
        out: Json = {"vllm": {"dir": str(llm), "bytes": weights_of(llm)}}
    else:
        out = {"vllm": write_llama(workdir / "vllm_llm", LLM_CONFIG)}
        torch_cfg = {**LLM_CONFIG, "num_hidden_layers": torch_layers}
    out["torch"] = write_llama(workdir / "torch_llm", torch_cfg)
    ensure_tokenizer(workdir / "torch_llm")
    out |= {"smoke": smoke, "torch_layers": torch_layers}
    built.write_text(json.dumps(out))
    return out


def weights_of(model_dir: Path) -> int:
    return sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))


# ---- the device, seen from outside ----------------------------------------------------------


class Outside:
    """The device as nvidia-smi shows it (smoke: the simulated GPU's snapshot)."""

    def __init__(self, fake_dir: Path | None) -> None:
        self.fake_dir = fake_dir
        self._handle: Any = None
        if fake_dir is None:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
            if visible.startswith(("GPU-", "MIG-")):
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
            else:
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))

    def read(self) -> Json:
        if self.fake_dir is not None:
            from tests.fakegpu.device import FakeGpu

            snap = FakeGpu(self.fake_dir).snapshot()
            used = snap.device.reserve + snap.used_total
            return {"total": snap.device.total, "used": used, "free": snap.free}
        import pynvml

        info = pynvml.nvmlDeviceGetMemoryInfo(self._handle)
        return {"total": int(info.total), "used": int(info.used), "free": int(info.free)}


# ---- workers --------------------------------------------------------------------------------


@dataclass
class Worker:
    name: str
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    spawned_at: float

    @property
    def sleep_stub(self) -> sleep_service_pb2_grpc.SleepServiceStub:
        return sleep_service_pb2_grpc.SleepServiceStub(self.channel)

    def status(self) -> sleep_service_pb2.GetStatusResponse:
        reply: sleep_service_pb2.GetStatusResponse = self.sleep_stub.GetStatus(
            sleep_service_pb2.GetStatusRequest(), timeout=30
        )
        return reply

    def generate(self, prompt: str, tokens: int) -> list[int]:
        stub = inference_service_pb2_grpc.InferenceServiceStub(self.channel)
        request = inference_service_pb2.GenerateRequest(
            request_id=str(uuid.uuid4()), prompt=prompt, max_new_tokens=tokens
        )
        return list(stub.Generate(request, timeout=600).text.token_ids)

    def sleep(self, level: int) -> Json:
        request = sleep_service_pb2.SleepRequest(
            task_id=str(uuid.uuid4()), level=types_pb2.SleepLevel.ValueType(level)
        )
        start = time.perf_counter()
        reply = self.sleep_stub.Sleep(request, timeout=600)
        return ack_json(reply.ack, time.perf_counter() - start)

    def wake(self) -> Json:
        request = sleep_service_pb2.WakeUpRequest(task_id=str(uuid.uuid4()))
        start = time.perf_counter()
        reply = self.sleep_stub.WakeUp(request, timeout=600)
        return ack_json(reply.ack, time.perf_counter() - start)

    def stop(self) -> None:
        from tests.cluster.procs import terminate

        self.channel.close()
        terminate(self.proc, grace=120)


def worker_env(smoke: bool, fake_dir: Path | None, extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, **extra}
    paths = [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), str(REPO)]
    if smoke:
        paths.insert(0, str(STANDIN))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    if fake_dir is not None:
        env["OMNISTAGE_MEMORY_PROBE"] = "tests.fakegpu.probe:from_env"
        env["OMNISTAGE_FAKE_GPU"] = str(fake_dir)
        env["OMNISTAGE_CPU_THREADS"] = "1"
    return env


def start_worker(
    name: str, args: list[str], env: dict[str, str], log: Path, *, ready: str, timeout: float
) -> Worker:
    """Spawn ``omnistage-worker``; return once ``ready`` is SERVING on grpc.health.v1."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    cmd = [sys.executable, "-m", "omnistage_worker", "--host=127.0.0.1", f"--port={port}", *args]
    spawned = time.time()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} worker exited with {proc.returncode}:\n{tail}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=ready), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return Worker(name, proc, channel, spawned)
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise TimeoutError(f"{name} worker did not become healthy in {timeout}s")
        time.sleep(0.1)


def wait_state(worker: Worker, state: types_pb2.WorkerState.ValueType, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while worker.status().state != state:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{worker.name} never reached {types_pb2.WorkerState.Name(state)}")
        time.sleep(0.1)


# ---- the run --------------------------------------------------------------------------------


def run_child(args: list[str], timeout: float, script: Path | None = None) -> Json:
    cmd = [sys.executable, str(script or Path(__file__)), "--child", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    sys.stderr.write(proc.stderr[-4000:])
    if proc.returncode != 0:
        raise RuntimeError(f"child {args} failed with {proc.returncode}")
    data: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def vllm_args(a: argparse.Namespace, model: Path, memory: int) -> list[str]:
    args = [
        "--runner=ar", "--backend=vllm", f"--model={model}", "--device=cuda",
        "--initial-state=active", f"--vllm-memory-bytes={memory}",
        f"--vllm-max-model-len={a.max_model_len}", f"--residual-slack={a.residual_slack}",
    ]  # fmt: skip
    if a.enforce_eager:
        args.append("--vllm-enforce-eager")
    if a.attention_backend and a.attention_via == "arg":
        args.append(f"--vllm-attention-backend={a.attention_backend}")
    return args


def cycles(
    llm: Worker, outside: Outside, reference: list[int], a: argparse.Namespace
) -> list[Json]:
    out = []
    for level in [1] * a.l1_cycles + [2] * a.l2_cycles:
        slept = llm.sleep(level)
        device_after_sleep = outside.read()
        refusal = refused_while_asleep_tokens(llm)
        woke = llm.wake()
        tokens = llm.generate(PROMPT, a.tokens)
        out.append({
            "level": level, "sleep": slept, "wake": woke, "outside_after_sleep": device_after_sleep,
            "generate_while_asleep": refusal, "tokens_identical": tokens == reference,
        })  # fmt: skip
        print(json.dumps(out[-1]), file=sys.stderr, flush=True)
    return out


def refused_while_asleep_tokens(worker: Worker) -> str:
    try:
        worker.generate(PROMPT, 1)
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return "NOT REFUSED"


def handover(llm: Worker, tw: Worker, outside: Outside, reference: list[int], n: int) -> Json:
    """vLLM -> torch -> vLLM on the one GPU, each side's ACK before the other's wake."""
    steps: Json = {}
    t0 = time.perf_counter()
    steps["vllm_sleep"] = llm.sleep(1)
    steps["outside_after_vllm_sleep"] = outside.read()
    steps["torch_wake"] = tw.wake()
    steps["vllm_to_torch_seconds"] = time.perf_counter() - t0
    steps["outside_torch_active"] = outside.read()
    steps["torch_tokens"] = tw.generate("w10 w20 w30", n)
    t1 = time.perf_counter()
    steps["torch_sleep"] = tw.sleep(1)
    steps["vllm_wake"] = llm.wake()
    steps["torch_to_vllm_seconds"] = time.perf_counter() - t1
    steps["vllm_tokens_identical"] = llm.generate(PROMPT, n) == reference
    steps["outside_vllm_active"] = outside.read()
    return steps


def deepen_refused(llm: Worker) -> Json:
    first = llm.sleep(1)
    try:
        second: Json | str = llm.sleep(2)
    except grpc.RpcError as err:
        second = f"{err.code().name}: {err.details()}"
    woke = llm.wake()
    return {"sleep1_ok": first["ok"], "sleep2": second, "wake_ok": woke["ok"]}


def machine(smoke: bool) -> Json:
    """Where it ran (NVML only: this process takes no CUDA context)."""
    from importlib import metadata

    info: Json = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "cpus": os.cpu_count()}
    for package in ("torch", "vllm"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    if smoke:
        info["gpu"] = "simulated GPU (tests/fakegpu), stand-in engine (tests/fakevllm)"
        return info
    import pynvml

    pynvml.nvmlInit()
    name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
    info["gpu"] = name.decode() if isinstance(name, bytes) else str(name)
    driver = pynvml.nvmlSystemGetDriverVersion()
    info["driver"] = driver.decode() if isinstance(driver, bytes) else str(driver)
    return info


def run(a: argparse.Namespace) -> Json:
    work: Path = a.workdir
    work.mkdir(parents=True, exist_ok=True)
    report: Json = {"command": " ".join(sys.argv), "smoke": a.smoke, "machine": machine(a.smoke)}
    limit_size = 64 * MiB if a.smoke else 4 * GiB
    report["build"] = run_child(["build", str(work), "smoke" if a.smoke else "full",
                                 str(a.torch_layers)], 3600)  # fmt: skip
    if a.build_only:
        return report
    report["limits"] = run_child(["limits", str(limit_size)], 900, REPO / "bench/worker_sleep.py")
    fake_dir: Path | None = None
    if a.smoke:
        from tests.fakegpu.device import FakeGpu
        from tests.fakegpu.model import Device

        fake_dir = work / "fakegpu"
        FakeGpu.create(fake_dir, Device(uuid="GPU-smoke", total=8_000_000))
    outside = Outside(fake_dir)
    total = outside.read()["total"]
    memory = int(total * a.vllm_fraction)
    extra = {"VLLM_ATTENTION_BACKEND": a.attention_backend} if a.attention_via == "env" else {}
    env = worker_env(a.smoke, fake_dir, extra)
    device = "cpu" if a.smoke else "cuda"
    torch_args = [
        "--runner=ar", "--backend=transformers", f"--model={work / 'torch_llm'}",
        f"--device={device}", "--dtype=" + ("float32" if a.smoke else "bfloat16"),
        "--initial-state=asleep", "--sleep-level=1",
    ]  # fmt: skip
    tw = start_worker("torch", torch_args, env, work / "torch.log", ready=SLEEP, timeout=900)
    llm: Worker | None = None
    try:
        wait_state(tw, types_pb2.WORKER_STATE_ASLEEP, 900)
        report["outside_before_vllm"] = outside.read()
        args = vllm_args(a, work / "vllm_llm", memory)
        report["vllm_args"] = args
        llm = start_worker("vllm", args, env, work / "vllm.log", ready=INFERENCE, timeout=1800)
        reference = llm.generate(PROMPT, a.tokens)
        report["cold_start_seconds"] = time.time() - llm.spawned_at
        st = llm.status()
        report["vllm_status"] = {
            "used_bytes": st.used_bytes, "total_bytes": st.total_bytes,
            "active_footprint_bytes": st.active_footprint_bytes,
            "source": types_pb2.MemorySource.Name(st.source),
        }  # fmt: skip
        report["outside_vllm_active"] = outside.read()
        report["reference_tokens"] = reference
        report["cycles"] = cycles(llm, outside, reference, a)
        report["deepen"] = deepen_refused(llm)
        report["handover"] = handover(llm, tw, outside, reference, a.tokens)
    finally:
        if llm is not None:
            llm.stop()
        tw.stop()
    report["summary"] = summarize(report)
    return report


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def summarize(r: Json) -> Json:
    weights = r["build"]["vllm"]["bytes"]
    lim = r["limits"]
    out: Json = {"weights_gib": weights / GiB, "cold_start_seconds": r["cold_start_seconds"]}
    for level in (1, 2):
        rows = [c for c in r["cycles"] if c["level"] == level]
        if not rows:
            continue
        sleep_s = _median([c["sleep"]["worker_seconds"] for c in rows])
        wake_s = _median([c["wake"]["worker_seconds"] for c in rows])
        out[f"l{level}_sleep_seconds_median"] = sleep_s
        out[f"l{level}_wake_seconds_median"] = wake_s
        out[f"l{level}_wake_gbps"] = weights / wake_s / 1e9
        out[f"l{level}_max_residual_bytes"] = max(c["sleep"]["used_after_bytes"] for c in rows)
        out[f"l{level}_residual_bound_bytes"] = rows[0]["sleep"]["residual_bound_bytes"]
        out[f"l{level}_max_outside_used_after_sleep_bytes"] = max(
            c["outside_after_sleep"]["used"] for c in rows
        )
        if level == 1:
            out["l1_sleep_gbps"] = weights / sleep_s / 1e9
            out["l1_sleep_ratio_to_d2h"] = out["l1_sleep_gbps"] / lim["d2h_pinned_gbps"]
            out["l1_wake_ratio_to_h2d"] = out["l1_wake_gbps"] / lim["h2d_pinned_gbps"]
    h = r["handover"]
    out["handover_vllm_to_torch_seconds"] = h["vllm_to_torch_seconds"]
    out["handover_torch_to_vllm_seconds"] = h["torch_to_vllm_seconds"]
    acks = [c["sleep"] for c in r["cycles"]] + [c["wake"] for c in r["cycles"]]
    acks += [h["vllm_sleep"], h["torch_wake"], h["torch_sleep"], h["vllm_wake"]]
    out["all_acks_ok"] = all(a["ok"] for a in acks)
    out["all_tokens_identical"] = all(c["tokens_identical"] for c in r["cycles"]) and bool(
        h["vllm_tokens_identical"]
    )
    out["all_refused_while_asleep"] = all(
        c["generate_while_asleep"].startswith("FAILED_PRECONDITION") for c in r["cycles"]
    )
    out["deepen_refused"] = str(r["deepen"]["sleep2"]).startswith("FAILED_PRECONDITION")
    out["residual_within_bound"] = all(
        c["sleep"]["used_after_bytes"] <= c["sleep"]["residual_bound_bytes"] for c in r["cycles"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/osbench/vllm"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, stand-in engine")
    parser.add_argument("--l1-cycles", type=int, default=3)
    parser.add_argument("--l2-cycles", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--vllm-fraction",
        type=float,
        default=0.85,
        help="the vLLM stage's memory as a share of the device (its vram.request)",
    )
    parser.add_argument("--torch-layers", type=int, default=8, help="layers of the torch model")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--residual-slack", default="256Mi")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--attention-backend", default="TRITON_ATTN")
    parser.add_argument("--attention-via", choices=("arg", "env", "none"), default="arg",
                        help="how the backend reaches vLLM: engine argument or "
                        "VLLM_ATTENTION_BACKEND")  # fmt: skip
    parser.add_argument("--build-only", action="store_true", help="limits and models only")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = parser.parse_args()
    if a.child:
        what, *rest = a.child
        if what != "build":
            raise SystemExit(f"unknown child {what}")
        print(json.dumps(child_build(Path(rest[0]), rest[1] == "smoke", int(rest[2]))))
        return
    emit(run(a), a.out)


if __name__ == "__main__":
    main()
