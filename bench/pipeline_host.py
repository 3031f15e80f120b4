"""What ``bench/pipeline.py`` needs on the GPU host beside the runs themselves.

- the model size the host's disk can hold: Qwen-Image's shape (``FULL``), with fewer DiT
  layers only when the disk cannot take both stages' weights (:func:`size_for_disk`; the JSON
  says so);
- each run's memory against the room, from the outside NVML sampler's file: the most the
  stages' processes (every process but the ballast) held together in one reading
  (:func:`room_check`);
- the runs finished so far, kept in the work folder so that a second call (the device tool runs
  at most 10 minutes a command) goes on where the first stopped (:class:`RunStore`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from bench.gpu_e2e_analysis import GiB, read_samples
from bench.qwen_image_like import FULL, QwenImageSize

Json = dict[str, Any]
BF16 = 2
DISK_MARGIN = 3 * GiB  # the bundle, the cluster's files, logs
MIN_DIT_LAYERS = 20


def weight_bytes(size: QwenImageSize) -> tuple[int, int, int]:
    """bf16 bytes of the encoder, of one DiT block, and of the DiT stage without its blocks
    (counted on the meta device: nothing is allocated)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from bench.qwen_image_like import dit_pipeline

    config = Qwen2Config(
        vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.enc_ff,
        num_hidden_layers=size.enc_layers, num_attention_heads=size.enc_heads,
        num_key_value_heads=size.enc_kv_heads, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        encoder = sum(p.numel() for p in Qwen2ForCausalLM(config).parameters())
    one = dataclasses.replace(size, dit_layers=1)
    two = dataclasses.replace(size, dit_layers=2)
    counts = []
    for s in (one, two):
        pipe = dit_pipeline(s, "meta")
        counts.append(sum(p.numel() for m in (pipe.transformer, pipe.vae) for p in m.parameters()))
    block = counts[1] - counts[0]
    return encoder * BF16, block * BF16, (counts[0] - block) * BF16


def size_for_disk(free_bytes: int, base: QwenImageSize = FULL) -> tuple[QwenImageSize, Json]:
    """``base``, or ``base`` with as many DiT blocks as ``free_bytes`` holds beside the encoder."""
    encoder, block, rest = weight_bytes(base)
    fit = (free_bytes - DISK_MARGIN - encoder - rest) // block
    layers = min(base.dit_layers, int(fit))
    if layers < MIN_DIT_LAYERS:
        raise SystemExit(
            f"disk: {free_bytes / GiB:.1f} GiB free holds {layers} DiT blocks "
            f"(< {MIN_DIT_LAYERS}); free the disk first"
        )
    size = dataclasses.replace(base, dit_layers=layers)
    info: Json = {
        "free_disk_bytes": free_bytes,
        "dit_layers": layers,
        "dit_layers_qwen_image": base.dit_layers,
        "shrunk_for_disk": layers < base.dit_layers,
        "expected_encoder_bytes": encoder,
        "expected_dit_bytes": rest + layers * block,
    }
    return size, info


def room_check(samples: Path, room_bytes: int | None, since: float, until: float) -> Json:
    """The sampler's readings in ``[since, until]``: the most every process but the ballast
    held together, the device's least free memory, and whether the first stayed in the room."""
    readings, cmdlines = read_samples(samples)
    inside = [s for s in readings if since <= s.t <= until]
    ballast = {pid for pid, cmd in cmdlines.items() if " ballast " in f" {cmd} "}
    stages = [sum(b for pid, b in s.procs.items() if pid not in ballast) for s in inside]
    peak = max(stages, default=0)
    out: Json = {
        "samples": len(inside),
        "peak_stages_bytes": peak,
        "peak_used_bytes": max((s.used for s in inside), default=0),
        "min_free_bytes": min((s.free for s in inside), default=0),
        "ballast_pids": sorted(ballast),
    }
    if room_bytes is not None:
        out["room_bytes"] = room_bytes
        out["within_room"] = bool(inside) and peak <= room_bytes
    return out


def device_idle(index: int = 0) -> bool:
    """No process holds memory on the device (the last run's workers are gone)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return not pynvml.nvmlDeviceGetComputeRunningProcesses(handle)


class RunStore:
    """``runs.json`` in the work folder: the finished runs of one setting (``key``)."""

    def __init__(self, work: Path, key: Json) -> None:
        self.path = work / "runs.json"
        self.key = key
        self.runs: list[Json] = []
        if self.path.exists():
            saved = json.loads(self.path.read_text())
            if saved.get("key") == key:
                self.runs = saved["runs"]

    def done(self, kind: str) -> Json | None:
        return next((r for r in self.runs if r["run"] == kind), None)

    def add(self, run: Json) -> None:
        self.runs = [r for r in self.runs if r["run"] != run["run"]] + [run]
        self.path.write_text(json.dumps({"key": self.key, "runs": self.runs}))
