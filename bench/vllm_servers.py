"""The servers a vLLM bench starts: bare vLLM's OpenAI server and a vLLM stage (the worker of
this tree), with the same engine flags, model and environment (``bench/serving_vllm.py``,
``bench/vllm_conformance.py``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
STANDIN = REPO / "tests" / "fakevllm"
Json = dict[str, Any]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- model ----------------------------------------------------------------------------------


def build_model(workdir: Path, smoke: bool) -> Json:
    """The model directory (reused when already built there)."""
    from bench.vllm_tokenizer import SIZE, save_byte_tokenizer

    model = workdir / "llm"
    done = workdir / "built.json"
    if done.exists():
        built: Json = json.loads(done.read_text())
        if built.get("smoke") == smoke:
            return built
    if smoke:
        from tests.fakevllm.models import build_standin_model

        build_standin_model(model, weights=400_000, max_position_embeddings=4096)
        built = {"dir": str(model), "bytes": (model / "model.safetensors").stat().st_size}
    else:
        from bench.vllm_stage_models import LLM_CONFIG, write_llama

        # The vocabulary is the tokenizer's (every generated id decodes); the layers make ~8 GiB.
        built = write_llama(model, {**LLM_CONFIG, "vocab_size": SIZE, "bos_token_id": 256,
                                    "eos_token_id": 257})  # fmt: skip
        save_byte_tokenizer(model, 4096)
    built["smoke"] = smoke
    done.write_text(json.dumps(built))
    return built


# ---- servers --------------------------------------------------------------------------------


@dataclass
class Server:
    name: str
    proc: subprocess.Popen[bytes]
    port: int
    grpc_port: int = 0
    started: float = field(default_factory=time.monotonic)
    ready_s: float = 0.0

    def stop(self) -> None:
        from tests.cluster.procs import terminate

        terminate(self.proc, grace=120)


def env_for(smoke: bool, fake_dir: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), str(REPO)]
    if smoke:
        paths.insert(0, str(STANDIN))
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    if fake_dir is not None:
        env["OMNISTAGE_MEMORY_PROBE"] = "tests.fakegpu.probe:from_env"
        env["OMNISTAGE_FAKE_GPU"] = str(fake_dir)
    return env


def worker_config(a: argparse.Namespace, model: Path) -> Any:
    """The stage's worker configuration (the flags the operator would give its pod)."""
    from omnistage_worker.cli import build_parser, config_from_args

    return config_from_args(build_parser({}).parse_args(worker_flags(a, model)))


def worker_flags(a: argparse.Namespace, model: Path) -> list[str]:
    flags = [
        "--runner=ar", "--backend=vllm", f"--model={model}", "--device=cuda",
        "--initial-state=active", "--served-model-name=llm",
        f"--vllm-gpu-memory-utilization={a.utilization}",
        f"--vllm-max-model-len={a.max_model_len}", f"--vllm-max-num-seqs={a.max_num_seqs}",
        f"--residual-slack={a.residual_slack}",
    ]  # fmt: skip
    if a.enforce_eager:
        flags.append("--vllm-enforce-eager")
    if a.attention_backend:
        flags.append(f"--vllm-attention-backend={a.attention_backend}")
    return flags


async def wait_http(server: Server, path: str, within: float) -> None:
    import httpx

    deadline = time.monotonic() + within
    async with httpx.AsyncClient() as client:
        while True:
            if server.proc.poll() is not None:
                raise RuntimeError(f"{server.name} exited with {server.proc.returncode}")
            try:
                reply = await client.get(f"http://127.0.0.1:{server.port}{path}", timeout=5)
                if reply.status_code == 200 and (path != "/health" or _active(reply.json())):
                    server.ready_s = time.monotonic() - server.started
                    return
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                server.proc.kill()
                raise TimeoutError(f"{server.name} not ready in {within}s")
            await asyncio.sleep(0.5)


def _active(body: Any) -> bool:
    """The worker's /health says Active (vLLM's own answers no JSON body)."""
    return not isinstance(body, dict) or body.get("state") == "WORKER_STATE_ACTIVE"


def start_bare(a: argparse.Namespace, model: Path, env: dict[str, str], log: Path) -> Server:
    """vLLM's own OpenAI server with the stage's engine flags."""
    from omnistage_worker.runners.vllm_serve import serve_argv

    argv = serve_argv(worker_config(a, model), a.utilization, tokenizer=True)
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server("bare", proc, port)


def start_stage(
    a: argparse.Namespace, model: Path, env: dict[str, str], log: Path, activation: str
) -> Server:
    port, grpc_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "omnistage_worker", "--host=127.0.0.1",
           f"--port={grpc_port}", f"--http-port={port}", f"--activation={activation}",
           *worker_flags(a, model)]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    return Server(f"stage-{activation}", proc, port, grpc_port)


def machine(smoke: bool) -> Json:
    info: Json = {"host": platform.node(), "python": platform.python_version(),
                  "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}  # fmt: skip
    if not smoke:
        import torch
        import vllm

        info |= {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
                 "vllm": vllm.__version__}  # fmt: skip
    return info


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's flags and the stage's start, shared by the benches that start a vLLM stage."""
    p.add_argument("--utilization", type=float, default=0.5)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--attention-backend", default="TRITON_ATTN")
    p.add_argument("--residual-slack", default="512Mi")
    p.add_argument("--start-timeout", type=float, default=600)
