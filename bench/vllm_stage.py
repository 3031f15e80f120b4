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
tree, residual bound; ``--l1-rested-cycles`` more level-1 cycles asleep ``--rest-s``
first), the device's NVML used memory after each sleep as an outside observer sees it,
Generate refused while asleep, token ids identical after every wake, 1 -> 2 refused while
asleep, and ``--handovers`` hand-overs vLLM -> torch -> vLLM on the one GPU (the vLLM stage's
wake as the operator orders it). On a GPU it ends, once the stage has stopped, by timing the
same level-1 wake without vLLM over the layout the stage's sleep logged
(``bench/vllm_wake_floor.py``): each wake against its floor.

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
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

import grpc  # noqa: E402

from bench import vllm_wake_floor  # noqa: E402
from bench.reporting import emit  # noqa: E402
from bench.vllm_stage_models import LLM_CONFIG, child_build  # noqa: E402
from bench.vllm_stage_prewarm import prewarmed_start  # noqa: E402
from bench.vllm_stage_summary import summarize  # noqa: E402
from bench.vllm_stage_workers import (  # noqa: E402
    Outside,
    PhaseLog,
    Worker,
    start_worker,
    wait_state,
    worker_env,
)
from bench.worker_grpc import INFERENCE, SLEEP  # noqa: E402
from omnistage.worker.v1 import types_pb2  # noqa: E402
from omnistage_worker.runners.vllm_wake import WAKE_ORDER_ENV  # noqa: E402
from omnistage_worker.runners.vllm_wake_plan import WAKE_ORDERS  # noqa: E402

Json = dict[str, Any]
GiB = 1024**3
MiB = 1024**2
PROMPT = "omnistage vllm stage bench prompt"  # UTF-8 bytes are the token ids (no tokenizer)


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
    if not a.fast_wake:
        args.append("--no-vllm-fast-wake")
    return args


def cycles(
    llm: Worker, outside: Outside, reference: list[int], a: argparse.Namespace, phases: PhaseLog
) -> list[Json]:
    out = []
    plan = [(1, 0.0)] * a.l1_cycles + [(2, 0.0)] * a.l2_cycles
    plan += [(1, a.rest_s)] * a.l1_rested_cycles
    for level, rest_s in plan:
        slept = llm.sleep(level)
        sleep_phases = phases.take()
        device_after_sleep = outside.read()
        refusal = refused_while_asleep_tokens(llm)
        time.sleep(rest_s)  # asleep as long as another stage would serve in a hand-over
        woke = llm.wake()
        wake_phases = phases.take()
        tokens = llm.generate(PROMPT, a.tokens)
        out.append({
            "level": level, "rest_s": rest_s, "sleep": slept, "wake": woke,
            "outside_after_sleep": device_after_sleep,
            "generate_while_asleep": refusal, "tokens_identical": tokens == reference,
            "sleep_phases": sleep_phases, "wake_phases": wake_phases,
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
    # the worker's and engine's switches in effect (OMNISTAGE_VLLM_MAP_PIECES=0, ...)
    report["omnistage_env"] = {k: v for k, v in os.environ.items() if k.startswith("OMNISTAGE_")}
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
    extra[WAKE_ORDER_ENV] = a.wake_order
    extra.update(cache_env(a.cache_dir or work / "compile_cache"))
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
        report["compile_cache_before"] = cache_contents(env)
        llm = start_worker("vllm", args, env, work / "vllm.log", ready=INFERENCE, timeout=1800)
        phases = PhaseLog(work / "vllm.log")
        report["start_phases"] = phases.take()  # the calibration's sleep (pins) and wake
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
        report["cycles"] = cycles(llm, outside, reference, a, phases)
        report["deepen"] = deepen_refused(llm)
        report["handovers"] = [
            handover(llm, tw, outside, reference, a.tokens) for _ in range(a.handovers)
        ]
        report["handover"] = report["handovers"][0]
        for n in range(a.restarts):  # the stage's pod again, its caches kept (as on a volume)
            llm.stop()
            llm = None
            before = cache_contents(env)
            log = work / f"vllm_restart{n + 1}.log"
            llm = start_worker("vllm", args, env, log, ready=INFERENCE, timeout=1800)
            tokens = llm.generate(PROMPT, a.tokens)
            report.setdefault("restarts", []).append({
                "cold_start_seconds": time.time() - llm.spawned_at,
                "compile_cache_before": before, "tokens_identical": tokens == reference,
            })  # fmt: skip
        for n in range(a.prewarmed):  # the pod pre-warmed asleep, its engine started by a wake
            llm.stop()
            llm = None
            log = work / f"vllm_prewarmed{n + 1}.log"
            llm, figures = prewarmed_start(
                args, env, log, outside, prompt=PROMPT, tokens=a.tokens, reference=reference
            )
            report.setdefault("prewarmed", []).append(figures)
    finally:
        if llm is not None:
            llm.stop()
        tw.stop()
    if not a.smoke:  # the same wake's floor without vLLM, on the device it has given back
        report["wake_floor"] = vllm_wake_floor.measure(report, LLM_CONFIG, a.rest_s, work)
    report["summary"] = summarize(report)
    return report


CACHE_DIRS = {"VLLM_CACHE_ROOT": "vllm", "TRITON_CACHE_DIR": "triton",
              "TORCHINDUCTOR_CACHE_DIR": "inductor"}  # fmt: skip
"""The variables naming where vLLM, Triton and Inductor keep what they compile, and each one's
folder under the bench's cache root."""


def cache_env(root: Path) -> dict[str, str]:
    """Their caches in one folder, as a stage's volume would hold them across its pod's
    restarts."""
    return {name: str(root / folder) for name, folder in CACHE_DIRS.items()}


def cache_contents(env: dict[str, str]) -> Json:
    """Files and bytes in each compile cache folder before a start (0: a cold cache)."""
    out: Json = {}
    for name in CACHE_DIRS:
        files = [f for f in Path(env[name]).rglob("*") if f.is_file()]
        out[name] = {"files": len(files), "bytes": sum(f.stat().st_size for f in files)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/osbench/vllm"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny, stand-in engine")
    parser.add_argument("--l1-cycles", type=int, default=3)
    parser.add_argument("--l2-cycles", type=int, default=2)
    parser.add_argument(
        "--l1-rested-cycles",
        type=int,
        default=2,
        help="level-1 cycles more, each asleep --rest-s before its wake",
    )
    parser.add_argument(
        "--rest-s",
        type=float,
        default=3.0,
        help="seconds a rested cycle stays asleep (another stage's turn in a hand-over)",
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument(
        "--handovers",
        type=int,
        default=1,
        help="hand-overs vLLM -> torch -> vLLM (the vLLM wake as the operator orders it)",
    )
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
    parser.add_argument(
        "--fast-wake",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the worker's fast sleep/wake (--no-fast-wake: vLLM's own)",
    )
    parser.add_argument(
        "--wake-order",
        choices=WAKE_ORDERS,
        default="overlap",
        help=f"{WAKE_ORDER_ENV}: the fast wake's order of maps and copies",
    )
    parser.add_argument(
        "--restarts",
        type=int,
        default=1,
        help="start the vLLM stage again this many times at the end, its compile caches kept",
    )
    parser.add_argument(
        "--prewarmed",
        type=int,
        default=0,
        help="then start it this many times pre-warmed (asleep at level 2) and wake it",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        help="vLLM's, Triton's and Inductor's caches (default: <workdir>/compile_cache)",
    )
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
