"""The AR batcher's decode steps replayed as CUDA graphs against the same steps run eagerly.

On the GPU host (the exact command is in bench/results/README.md):

    python bench/decode_graphs.py --out $OUT/decode_graphs.json

Builds a Llama of the 16.6 GiB model's width (random weights; ``--layers`` of its 36) on the
GPU, then for each mode (``eager``: ``graphs=False``; ``graphs``) drives the worker's
:class:`DecodeBatcher` in this process:

1. identity: requests of different prompt lengths submitted in a staggered way (so they join a
   running batch), greedy, in float32; each request's tokens against the same request run alone
   eagerly (the reference);
2. speed (bf16): one request, and ``--clients`` closed-loop threads for ``--seconds``: tokens/s,
   ms per step, rows per step, join steps, captures, replays and the seconds captures took.

3. what each mode's batches leave on the device once they end: NVML's figure for this process
   after the batcher is idle and the caches are emptied, less the same figure before it ran
   (the CUDA graphs and their memory pools must go with the batch, as a sleep needs).

The summary holds ``graphs_over_eager`` (closed-loop tokens/s), the identity counts and the
largest ``left_on_device_mib`` per mode.
``--smoke`` runs the same code on CPU with a tiny model (graphs stay off there: CUDA only).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
for extra in ("worker_image/src", "protos/gen/python", "."):
    sys.path.insert(0, str(REPO / extra))

from bench.reporting import emit  # noqa: E402
from bench.threads import run_threads  # noqa: E402

Json = dict[str, Any]


def build(layers: int, smoke: bool, device: Any, dtype: Any) -> Any:
    """A Llama of the bench model's width with ``layers`` layers (random weights)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from bench.serving_models import llm_config

    config: Any = llm_config(smoke)
    if not smoke:
        config = LlamaConfig(**{**config.to_dict(), "num_hidden_layers": layers})
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with device:
        model = LlamaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.eval()  # type: ignore[no-untyped-call]
    return model


def batcher(model: Any, device: Any, graphs: bool, max_batch: int) -> Any:
    from omnistage_worker.runners.decode_batch import DecodeBatcher

    class Tokens:
        def decode(self, ids: list[int], **_: Any) -> str:
            return " ".join(str(i) for i in ids)

    return DecodeBatcher(
        model,
        tokenizer=Tokens(),
        device=device,
        max_batch=max_batch,
        eos_ids=set(),
        pad_id=0,
        graphs=graphs,
    )


def job(index: int, new_tokens: int, vocab: int) -> Any:
    from omnistage.worker.v1 import inference_service_pb2 as pb
    from omnistage_worker.runners.decode_batch import Job
    from omnistage_worker.runners.sampling import Sampling

    length = 5 + (index * 7) % 29
    ids = [(index * 7919 + i * 31) % (vocab - 1) + 1 for i in range(length)]
    return Job(pb.GenerateRequest(), ids, new_tokens, Sampling(greedy=True), None)


def identity(model: Any, device: Any, requests: int, new_tokens: int) -> Json:
    """Each request's greedy tokens, batched with staggered joins, against it run alone."""
    vocab = model.config.vocab_size
    alone = batcher(model, device, False, 8)
    reference = [
        list(alone.submit(job(i, new_tokens, vocab)).result().text.token_ids)
        for i in range(requests)
    ]
    alone.close()
    out: Json = {}
    for mode in ("eager", "graphs"):
        run = batcher(model, device, mode == "graphs", 16)
        futures = []
        for i in range(requests):
            futures.append(run.submit(job(i, new_tokens, vocab)))
            deadline = time.monotonic() + 10
            while run.steps < 3 * (i + 1) and time.monotonic() < deadline:
                time.sleep(0.001)  # let the batch run a few steps before the next one joins
        got = [list(f.result().text.token_ids) for f in futures]
        out[mode] = {
            "identical": sum(g == r for g, r in zip(got, reference, strict=True)),
            "requests": requests,
            "captures": run._graphs.captures,
            "replays": run._graphs.replays,
            "steps": run.steps,
        }
        run.close()
    return out


def device_used_mib() -> float:
    """NVML's figure for this process after the caches are emptied (-1 without NVML)."""
    import os

    import torch

    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return float(proc.usedGpuMemory) / 2**20
    except Exception:  # a figure we report, not one we need
        pass
    return -1.0


def speed(model: Any, device: Any, graphs: bool, args: argparse.Namespace) -> Json:
    """One request, then ``clients`` closed-loop threads: tokens/s and the batcher's counters."""
    vocab = model.config.vocab_size
    clients, seconds, new = args.clients, args.seconds, args.new_tokens
    run = batcher(model, device, graphs, 64)
    run.submit(job(0, new, vocab)).result()  # warm
    began = time.perf_counter()
    one = len(run.submit(job(1, new, vocab)).result().text.token_ids) / (
        time.perf_counter() - began
    )
    stop = time.monotonic() + seconds
    done: list[int] = []

    def loop(index: int) -> None:
        turn = 0
        while time.monotonic() < stop:
            answer = run.submit(job(index * 100 + turn, new, vocab)).result()
            done.append(len(answer.text.token_ids))
            turn += 1

    cuda = device.type == "cuda"
    before = device_used_mib() if cuda else 0.0
    steps0, rows0, joins0, secs0 = run.steps, run.row_steps, run.join_steps, run.step_seconds
    began = time.perf_counter()
    run_threads(clients, loop)
    elapsed = time.perf_counter() - began
    steps = run.steps - steps0
    out = {
        "one_tokens_per_s": one,
        "clients": clients,
        "tokens_per_s": sum(done) / elapsed,
        "steps": steps,
        "mean_rows": (run.row_steps - rows0) / max(steps, 1),
        "join_steps": run.join_steps - joins0,
        "ms_per_step": 1000 * (run.step_seconds - secs0) / max(steps, 1),
        "captures": run._graphs.captures,
        "replays": run._graphs.replays,
        "capture_seconds": run._graphs.capture_seconds,
        "capture_failures": run._graphs.failures,
    }
    run.close()
    out["left_on_device_mib"] = device_used_mib() - before if cuda else 0.0
    return out


def main(argv: list[str] | None = None) -> Json:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--identity-layers", type=int, default=4)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    out: Json = {"command": " ".join(sys.argv), "device": str(device)}
    if device.type == "cuda":
        out["gpu"] = torch.cuda.get_device_name(device)
    out["torch"] = torch.__version__
    import transformers

    out["transformers"] = transformers.__version__
    small = build(args.identity_layers, args.smoke, device, torch.float32)
    out["identity_float32"] = identity(small, device, 12, 24 if not args.smoke else 6)
    del small
    dtype = torch.float32 if args.smoke else torch.bfloat16
    model = build(args.layers, args.smoke, device, dtype)
    out["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    if args.smoke:
        args.new_tokens, args.clients, args.seconds = 8, 4, 1.0
    runs: dict[str, list[Json]] = {"eager": [], "graphs": []}
    for _ in range(2):  # in turns, so drift on the machine falls on both
        for mode in ("eager", "graphs"):
            runs[mode].append(speed(model, device, mode == "graphs", args))
            print(f"{mode}: {runs[mode][-1]}", flush=True)
    out["speed"] = runs
    rates = {m: statistics.median(r["tokens_per_s"] for r in runs[m]) for m in runs}
    ones = {m: statistics.median(r["one_tokens_per_s"] for r in runs[m]) for m in runs}
    out["summary"] = {
        "graphs_over_eager": rates["graphs"] / rates["eager"],
        "one_request_graphs_over_eager": ones["graphs"] / ones["eager"],
        "tokens_per_s": rates,
        "identical_graphs": out["identity_float32"]["graphs"]["identical"],
        "identical_eager": out["identity_float32"]["eager"]["identical"],
        "requests": 12,
        "left_on_device_mib": {m: max(r["left_on_device_mib"] for r in runs[m]) for m in runs},
    }
    emit(out, args.out)
    return out


if __name__ == "__main__":
    main()
