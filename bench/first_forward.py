"""Why a fresh worker's first forward is slow: timed alone, and beside the engine's host pinning.

    python bench/first_forward.py --pin-gib 0      # the first forward alone
    python bench/first_forward.py --pin-gib 16.6   # while the engine page-locks its host copy

One process: the 16.6 GiB model's shapes with 2 decoder layers (the same kernels, less memory),
random bf16 weights made on the GPU, then a 4-token prefill and one decode step with a
DynamicCache (the worker's warm-up), then the same again. With ``--pin-gib`` the engine's own
background page-locking of a host buffer of that size (``HostBufferFuture``, as ``activate``
starts it) begins just before the first forward. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "worker_image/src"), str(REPO)]

GiB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pin-gib", type=float, default=0.0)
    args = parser.parse_args()
    started = time.perf_counter()
    import torch
    from transformers import DynamicCache, LlamaForCausalLM

    from bench.serving_models import llm_config
    from omnistage_worker.engine.host_memory import HostBufferFuture

    out: dict[str, float] = {"imports_s": time.perf_counter() - started}
    config = llm_config(False)
    config.num_hidden_layers = 2
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model: Any = LlamaForCausalLM(config)
    model.eval()
    torch.cuda.synchronize()
    out["model_s"] = time.perf_counter() - started - out["imports_s"]
    pin = HostBufferFuture(int(args.pin_gib * GiB), pin=True) if args.pin_gib > 0 else None
    pin_started = time.perf_counter()

    def two_tokens() -> float:
        t = time.perf_counter()
        cache = DynamicCache(config=model.config)
        ids = torch.tensor([[10, 20, 30, 40]], device="cuda")
        with torch.inference_mode():
            logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            model(input_ids=nxt, past_key_values=cache, use_cache=True)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    out["first_two_tokens_s"] = two_tokens()
    out["again_two_tokens_s"] = two_tokens()
    if pin is not None:
        buffer = pin.result()
        out["pin_s"] = time.perf_counter() - pin_started
        buffer.release()
    out["pin_gib"] = args.pin_gib
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
