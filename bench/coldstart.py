"""Cold start of the real worker: process spawn to the first token, with its phases and limits.

Run on the lent GPU machine (the exact command is in bench/results/README.md):

    python bench/coldstart.py --workdir /tmp/cold --out $OUT/coldstart.json

It builds the 16.6 GiB Llama-shaped causal LM of ``bench/worker_sleep.py`` (random bf16 weights
from its config, safetensors shards, a word-level tokenizer), measures the limits in the same run
(``bench/coldstart_limits.py``: page-cache read and pinned H2D bandwidth, the worker's own
file-to-device stream, the import and CUDA-context costs of a fresh process), then spawns
``python -m omnistage_worker`` with the flags the operator gives a stage and times, from the
spawn: gRPC health SERVING for inference, and the first token (a 1-token Generate). The worker's
log gives the phases (``startup: <phase> at ...`` lines of
:mod:`omnistage_worker.control.prestart`). Runs: ``--runs`` with the page cache warm, then one with
the weight files evicted from the page cache (POSIX_FADV_DONTNEED) and one after ``echo 3 >
/proc/sys/vm/drop_caches`` where permitted (every cached page of the machine: libraries too).
``--baseline-src DIR`` also runs, once, the worker source in DIR (an older tree's
``worker_image/src``) with the cache warm. ``--tiny`` does it all on CPU with a tiny model, to test
the script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.coldstart_limits import (  # noqa: E402
    drop_all_caches,
    evict,
    read_files,
    resident_fraction,
    weight_files,
)
from bench.reporting import code_version, emit  # noqa: E402
from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc  # noqa: E402

Json = dict[str, Any]
GiB = 1024**3
INFERENCE = "omnistage.worker.v1.InferenceService"
PHASE = re.compile(r"startup: (?P<phase>[^:]+?) at \+(?P<since>[\d.]+)s \(unix (?P<unix>[\d.]+)\)")
ACTIVATED = re.compile(
    r"model activated: (?P<bytes>\d+) weight bytes, \d+ bytes moved in (?P<s>[\d.]+)s"
)
WARM_UP = re.compile(r"warm-up: 2 tokens in (?P<s>[\d.]+)s")
AHEAD = re.compile(r"weights streamed ahead: (?P<bytes>\d+) bytes in (?P<s>[\d.]+)s")
# Reconnect fast while the worker is not listening yet (the default backoff starts at 1 s).
CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 5),
    ("grpc.min_reconnect_backoff_ms", 5),
    ("grpc.max_reconnect_backoff_ms", 20),
]


def parse_log(text: str, spawned_unix: float) -> Json:
    """The worker log's startup phases as seconds after the spawn, and its load figures."""
    phases: Json = {}
    for match in PHASE.finditer(text):
        phases[match["phase"]] = round(float(match["unix"]) - spawned_unix, 4)
    out: Json = {"phases_s": phases}
    if (m := ACTIVATED.search(text)) is not None:
        out["weights_bytes"] = int(m["bytes"])
        out["weights_to_device_s"] = float(m["s"])
    if (m := WARM_UP.search(text)) is not None:
        out["warm_up_s"] = float(m["s"])
    if (m := AHEAD.search(text)) is not None:
        out["streamed_ahead_s"] = float(m["s"])
    return out


def worker_command(
    model_dir: Path, device: str, port: int, http_port: int, token: Path
) -> list[str]:
    """``python -m omnistage_worker`` with the flags the operator gives an AR stage."""
    return [
        sys.executable,
        "-m",
        "omnistage_worker",
        "--runner",
        "ar",
        "--backend",
        "transformers",
        "--model",
        str(model_dir),
        "--host=127.0.0.1",
        "--port",
        str(port),
        "--initial-state",
        "active",
        "--sleep-level",
        "1",
        "--token-file",
        str(token),
        "--device",
        device,
        "--drain-timeout",
        "600",
        "--http-port",
        str(http_port),
    ]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def one_start(model_dir: Path, device: str, workdir: Path, label: str, src: Path | None) -> Json:
    """Spawn a worker, time SERVING and the first token, stop it; the run's record."""
    token = workdir / "token"
    token.write_text(uuid.uuid4().hex)
    port, http_port = free_port(), free_port()
    env = dict(os.environ)
    worker_src = src if src is not None else REPO / "worker_image/src"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(worker_src), str(REPO / "protos/gen/python"), env.get("PYTHONPATH", "")]
    )
    log_path = workdir / f"{label}.log"
    cmd = worker_command(model_dir, device, port, http_port, token)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=CHANNEL_OPTIONS)
    health = health_pb2_grpc.HealthStub(channel)
    inference = inference_service_pb2_grpc.InferenceServiceStub(channel)
    request = inference_service_pb2.GenerateRequest(
        request_id="first", prompt="w10 w20 w30 w40", max_new_tokens=1
    )
    with log_path.open("wb") as log:
        spawned_unix = time.time()
        spawned = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            serving = wait_serving(proc, health, log_path)
            serving_s = time.perf_counter() - spawned
            reply = inference.Generate(request, timeout=120)
            first_token_s = time.perf_counter() - spawned
            started = time.perf_counter()
            inference.Generate(request, timeout=120)
            second_s = time.perf_counter() - started
        finally:
            channel.close()
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    record: Json = {
        "label": label,
        "serving_s": round(serving_s, 4),
        "first_token_s": round(first_token_s, 4),
        "next_request_s": round(second_s, 4),
        "tokens": list(reply.text.token_ids),
        "connection_attempts": serving,
    }
    record.update(parse_log(log_path.read_text(errors="replace"), spawned_unix))
    print(json.dumps(record), file=sys.stderr, flush=True)
    return record


def wait_serving(proc: subprocess.Popen[bytes], health: Any, log_path: Path) -> int:
    """Watch the inference service's health until SERVING (a stream: no polling load on the
    worker, which a 5 ms poll slows by seconds); the number of connection attempts."""
    deadline = time.monotonic() + 600
    attempts = 0
    check = health_pb2.HealthCheckRequest(service=INFERENCE)
    while True:
        attempts += 1
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}; see {log_path}")
        try:
            for reply in health.Watch(check, timeout=max(1.0, deadline - time.monotonic())):
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return attempts
        except grpc.RpcError:
            pass  # not listening yet (refused at once) or the worker went away
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not become healthy")
        time.sleep(0.005)


def build(model_dir: Path, tiny: bool) -> Json:
    """The model (in a child: the parent keeps no CUDA context), once."""
    if (model_dir / "tokenizer.json").exists():
        return {"built": False}
    code = (
        "import sys, time, torch; from pathlib import Path; sys.path[:0] = sys.argv[3:]\n"
        "from transformers import LlamaForCausalLM\n"
        "from bench.serving_models import llm_config\n"
        "from bench.worker_grpc import ensure_tokenizer\n"
        "tiny = sys.argv[2] == 'tiny'; out = Path(sys.argv[1])\n"
        "dev = torch.device('cpu' if tiny else 'cuda'); torch.manual_seed(0)\n"
        "torch.set_default_dtype(torch.bfloat16)\n"
        "with dev: model = LlamaForCausalLM(llm_config(tiny))\n"
        "model.save_pretrained(out, max_shard_size='4GB'); ensure_tokenizer(out)\n"
    )
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", code, str(model_dir), "tiny" if tiny else "full", str(REPO)],
        check=True,
    )
    return {"built": True, "seconds": time.perf_counter() - started}


def limits(model_dir: Path, cuda: bool) -> Json:
    out = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench/coldstart_limits.py"),
            str(model_dir),
            "cuda" if cuda else "cpu",
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    result: Json = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def machine(cuda: bool) -> Json:
    info: Json = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "code": code_version(REPO),
    }
    if cuda:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        info["gpu"] = pynvml.nvmlDeviceGetName(handle)
        info["driver"] = pynvml.nvmlSystemGetDriverVersion()
    return info


def summarize(report: Json) -> Json:
    lim = report["limits"]
    warm = [r["first_token_s"] for r in report["warm"]]
    nbytes = lim["weight_bytes"]
    read_s = nbytes / (lim["read_gbps"] * 1e9)
    out: Json = {
        "weights_gib": nbytes / GiB,
        "cold_start_first_token_s": statistics.median(warm),
        "cold_start_first_token_runs_s": warm,
        "read_limit_s": read_s,
        "first_token_over_read_limit": statistics.median(warm) / read_s,
    }
    if "h2d_gbps" in lim:
        h2d_s = nbytes / (lim["h2d_gbps"] * 1e9)
        out["h2d_limit_s"] = h2d_s
        out["first_token_over_h2d_limit"] = statistics.median(warm) / h2d_s
        # a fresh process's fixed costs plus the bytes at the slower of read and copy
        floor = lim["import_model_s"] + max(read_s, h2d_s)
        out["process_floor_s"] = floor
        out["first_token_over_process_floor"] = statistics.median(warm) / floor
    cold = report.get("cold_dropped") or report.get("cold_evicted")
    if cold is not None:
        out["cold_start_first_token_cold_cache_s"] = cold["first_token_s"]
        out["cold_cache_method"] = "drop_caches" if "cold_dropped" in report else "fadvise"
    if "cold_evicted" in report:
        out["cold_start_first_token_weights_evicted_s"] = report["cold_evicted"]["first_token_s"]
    if "disk_read_gbps" in report:
        disk_s = nbytes / (report["disk_read_gbps"] * 1e9)
        out["disk_read_limit_s"] = disk_s
        if cold is not None:
            out["cold_cache_over_disk_limit"] = cold["first_token_s"] / disk_s
    if "baseline" in report:
        out["baseline_first_token_s"] = report["baseline"]["first_token_s"]
    out["same_tokens"] = len({tuple(r["tokens"]) for r in report["warm"]}) == 1
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "coldstart")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--runs", type=int, default=3, help="starts with the page cache warm")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache starts")
    parser.add_argument("--baseline-src", type=Path, help="another worker source to time once")
    parser.add_argument("--tiny", action="store_true", help="tiny model on CPU (tests the script)")
    parser.add_argument(
        "--pycache",
        type=Path,
        help="let every process cache compiled bytecode here (PYTHONPYCACHEPREFIX, "
        "PYTHONDONTWRITEBYTECODE unset), as the worker image has it: pip compiles its packages "
        "at install; without it, a Python environment shipped without bytecode compiles torch "
        "and transformers in every new process",
    )
    args = parser.parse_args()
    bytecode: Json = {"PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}
    if args.pycache is not None:
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(args.pycache)
        bytecode["PYTHONPYCACHEPREFIX"] = str(args.pycache)
    cuda = not args.tiny
    device = "cuda" if cuda else "cpu"
    args.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = args.workdir / "llm"
    report: Json = {"machine": machine(cuda), "command": " ".join(sys.argv), "bytecode": bytecode}
    report["build"] = build(model_dir, args.tiny)
    report["limits"] = limits(model_dir, cuda)
    print("limits", json.dumps(report["limits"]), file=sys.stderr, flush=True)
    report["warm"] = []
    for i in range(args.runs):
        report["warm"].append(one_start(model_dir, device, args.workdir, f"warm{i}", None))
        save(report, args.out)
    if args.baseline_src is not None:
        src = args.baseline_src
        report["baseline"] = one_start(model_dir, device, args.workdir, "baseline", src)
    if not args.no_cold:
        files = weight_files(model_dir)
        evict(files[:1])
        nbytes, seconds = read_files(files[:1])  # one shard: the disk's rate, 8 readers
        report["disk_read_gbps"] = nbytes / seconds / 1e9
        evict(files)
        report["resident_before_cold"] = resident_fraction(files)
        report["cold_evicted"] = one_start(model_dir, device, args.workdir, "evicted", None)
        save(report, args.out)
        if not args.tiny and drop_all_caches():  # never on a shared development machine
            report["resident_before_dropped"] = resident_fraction(files)
            report["cold_dropped"] = one_start(model_dir, device, args.workdir, "dropped", None)
    report["summary"] = summarize(report)
    emit(report, args.out)


def save(report: Json, out: Path | None) -> None:
    """The report so far (a run cut short by its time limit still leaves its figures)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
