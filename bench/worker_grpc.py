"""The real ``omnistage-worker`` on a GPU, driven over gRPC: its own ACKs as the operator sees them.

Run on the lent GPU machine after ``bench/worker_sleep.py`` built the models (see
bench/results/worker_sleep.md for the exact command):

    python bench/worker_grpc.py --model /tmp/osbench/llm --out $OUT/worker_grpc.json

It starts the worker (AR runner, transformers backend, bf16, CUDA), measures the cold start (process
spawn to the first Generate answer), then runs level-1 and level-2 sleep/wake cycles through
SleepService, recording each ACK (worker-side duration, NVML process memory before/after, freed
bytes, residual bound, ok) and the client-side round trip, checks that Generate is refused while
asleep and that the tokens after every wake equal the tokens before the first sleep, and finally
starts a second worker asleep at level 1 to show that it takes no weight memory until woken.
``--tiny`` builds a tiny model and runs on CPU, to test the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
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
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from bench.reporting import emit  # noqa: E402
from omnistage.worker.v1 import (  # noqa: E402
    inference_service_pb2,
    inference_service_pb2_grpc,
    sleep_service_pb2,
    sleep_service_pb2_grpc,
    types_pb2,
)

Json = dict[str, Any]
GiB = 1024**3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def ensure_tokenizer(model_dir: Path) -> None:
    """A word-level tokenizer covering the model's whole vocabulary, written beside the weights."""
    if (model_dir / "tokenizer.json").exists():
        return
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoConfig, PreTrainedTokenizerFast

    vocab_size = int(AutoConfig.from_pretrained(model_dir).vocab_size)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=raw,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    tokenizer.save_pretrained(model_dir)


def build_tiny(model_dir: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (model_dir / "config.json").exists():
        return
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(model_dir)


@dataclass
class Worker:
    proc: subprocess.Popen[bytes]
    channel: grpc.Channel
    spawned_at: float

    @property
    def sleep(self) -> sleep_service_pb2_grpc.SleepServiceStub:
        return sleep_service_pb2_grpc.SleepServiceStub(self.channel)

    @property
    def inference(self) -> inference_service_pb2_grpc.InferenceServiceStub:
        return inference_service_pb2_grpc.InferenceServiceStub(self.channel)

    def stop(self) -> None:
        self.channel.close()
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


INFERENCE = "omnistage.worker.v1.InferenceService"
SLEEP = "omnistage.worker.v1.SleepService"


def start_worker(
    model_dir: Path, device: str, extra: list[str], log_path: Path, ready_service: str
) -> Worker:
    """Spawn the worker; return once ``ready_service`` reports SERVING on grpc.health.v1."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "worker_image/src"), str(REPO / "protos/gen/python"), env.get("PYTHONPATH", "")]
    )
    cmd = [
        sys.executable,
        "-m",
        "omnistage_worker",
        "--runner=ar",
        "--backend=transformers",
        f"--model={model_dir}",
        f"--device={device}",
        "--dtype=bfloat16" if device.startswith("cuda") else "--dtype=float32",
        "--host=127.0.0.1",
        f"--port={port}",
        *extra,
    ]
    log = log_path.open("wb")
    spawned = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    status = sleep_service_pb2_grpc.SleepServiceStub(channel)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"worker exited with {proc.returncode}; see {log_path}")
        try:
            reply = health.Check(health_pb2.HealthCheckRequest(service=ready_service), timeout=2)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return Worker(proc, channel, spawned)
            state = status.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=2).state
            if state == types_pb2.WORKER_STATE_FAILED:  # it will never serve: say why now
                proc.terminate()
                tail = log_path.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"worker failed while starting; {log_path} ends:\n{tail}")
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("worker did not become healthy")
        time.sleep(0.05)


def generate(worker: Worker) -> list[int]:
    request = inference_service_pb2.GenerateRequest(
        request_id=str(uuid.uuid4()), prompt="w10 w20 w30 w40", max_new_tokens=16
    )
    reply = worker.inference.Generate(request, timeout=300)
    return list(reply.text.token_ids)


def ack_json(ack: types_pb2.Ack, round_trip: float) -> Json:
    return {
        "task_id": ack.task_id,
        "ok": ack.ok,
        "error": ack.error,
        "level": int(ack.level),
        "state": types_pb2.WorkerState.Name(ack.state),
        "source": types_pb2.MemorySource.Name(ack.source),
        "worker_seconds": ack.duration.ToTimedelta().total_seconds(),
        "round_trip_seconds": round_trip,
        "freed_bytes": ack.freed_bytes,
        "used_before_bytes": ack.used_before_bytes,
        "used_after_bytes": ack.used_after_bytes,
        "free_after_bytes": ack.free_after_bytes,
        "residual_bound_bytes": ack.residual_bound_bytes,
        "bytes_moved": ack.bytes_moved,
    }


def call_sleep(worker: Worker, level: int) -> Json:
    request = sleep_service_pb2.SleepRequest(
        task_id=str(uuid.uuid4()), level=types_pb2.SleepLevel.ValueType(level)
    )
    start = time.perf_counter()
    reply = worker.sleep.Sleep(request, timeout=300)
    return ack_json(reply.ack, time.perf_counter() - start)


def call_wake(worker: Worker) -> Json:
    request = sleep_service_pb2.WakeUpRequest(task_id=str(uuid.uuid4()))
    start = time.perf_counter()
    reply = worker.sleep.WakeUp(request, timeout=300)
    return ack_json(reply.ack, time.perf_counter() - start)


def refused_while_asleep(worker: Worker) -> str:
    try:
        generate(worker)
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return "NOT REFUSED"


def run(model_dir: Path, device: str, workdir: Path, l1: int, l2: int) -> Json:
    workdir.mkdir(parents=True, exist_ok=True)
    report: Json = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "device": device}
    worker = start_worker(
        model_dir, device, ["--initial-state=active"], workdir / "worker.log", INFERENCE
    )
    try:
        reference = generate(worker)
        report["cold_start_seconds"] = time.time() - worker.spawned_at
        status = worker.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)
        report["weights_bytes"] = status.weights_bytes
        report["active_footprint_bytes"] = status.active_footprint_bytes
        report["source"] = types_pb2.MemorySource.Name(status.source)
        cycles = []
        for level in [1] * l1 + [2] * l2:
            slept = call_sleep(worker, level)
            refusal = refused_while_asleep(worker)
            woke = call_wake(worker)
            tokens = generate(worker)
            cycles.append(
                {
                    "level": level,
                    "sleep": slept,
                    "wake": woke,
                    "generate_while_asleep": refusal,
                    "tokens_identical": tokens == reference,
                }
            )
            print(json.dumps(cycles[-1]), file=sys.stderr, flush=True)
        report["cycles"] = cycles
    finally:
        worker.stop()
    asleep = start_worker(
        model_dir,
        device,
        ["--initial-state=asleep", "--sleep-level=1"],
        workdir / "asleep.log",
        SLEEP,
    )
    try:
        status = asleep.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)
        deadline = time.monotonic() + 600
        while status.state != types_pb2.WORKER_STATE_ASLEEP and time.monotonic() < deadline:
            time.sleep(0.1)
            status = asleep.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)
        report["start_asleep_l1"] = {
            "used_bytes_before_wake": status.used_bytes,
            "state": types_pb2.WorkerState.Name(status.state),
            "wake": call_wake(asleep),
            "tokens_identical": generate(asleep) == reference,
        }
    finally:
        asleep.stop()
    report["summary"] = summarize(report)
    return report


def summarize(report: Json) -> Json:
    weights = report["weights_bytes"]
    out: Json = {"weights_gib": weights / GiB, "cold_start_seconds": report["cold_start_seconds"]}
    for level in (1, 2):
        rows = [c for c in report["cycles"] if c["level"] == level]
        later = rows[1:] if level == 1 else rows
        if not later:
            continue
        sleeps = sorted(c["sleep"]["worker_seconds"] for c in later)
        wakes = sorted(c["wake"]["worker_seconds"] for c in later)
        out[f"l{level}_sleep_seconds_median"] = sleeps[len(sleeps) // 2]
        out[f"l{level}_wake_seconds_median"] = wakes[len(wakes) // 2]
        out[f"l{level}_wake_gbps_median"] = weights / wakes[len(wakes) // 2] / 1e9
        out[f"l{level}_max_used_after_sleep_bytes"] = max(
            c["sleep"]["used_after_bytes"] for c in rows
        )
    out["all_acks_ok"] = all(c["sleep"]["ok"] and c["wake"]["ok"] for c in report["cycles"])
    out["all_tokens_identical"] = all(c["tokens_identical"] for c in report["cycles"])
    out["all_refused_while_asleep"] = all(
        c["generate_while_asleep"].startswith("FAILED_PRECONDITION") for c in report["cycles"]
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("/tmp/osbench/llm"))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/osbench/grpc"))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--l1-cycles", type=int, default=4)
    parser.add_argument("--l2-cycles", type=int, default=2)
    args = parser.parse_args()
    device = "cpu" if args.tiny else "cuda"
    if args.tiny:
        build_tiny(args.model)
    ensure_tokenizer(args.model)
    report = run(args.model, device, args.workdir, args.l1_cycles, args.l2_cycles)
    report["command"] = " ".join(sys.argv)
    emit(report, args.out)


if __name__ == "__main__":
    main()
