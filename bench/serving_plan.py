"""The sizes of a ``bench/serving.py`` run (the GPU run or the CPU smoke run) and the machine
it ran on."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

Json = dict[str, Any]


@dataclass(frozen=True)
class Plan:
    """Sizes of one run (the GPU run or the CPU smoke run)."""

    device: str
    dtype: str
    new_tokens: int
    clients: tuple[int, ...]
    generate_batches: tuple[int, ...]
    window_s: float
    warmup_s: float
    swap_seconds: float
    swap_every: float
    max_batch: int
    image_side: int
    image_steps: int
    image_clients: tuple[int, ...]
    image_requests: int


GPU = Plan("cuda", "bfloat16", 64, (1, 16, 64), (1, 16, 64), 15.0, 3.0, 120.0, 10.0, 64,
           512, 20, (1, 8), 24)  # fmt: skip
SMOKE = Plan("cpu", "float32", 8, (1, 4, 8), (1, 4, 8), 2.0, 0.5, 3.0, 1.0, 8,
             32, 4, (1, 4), 4)  # fmt: skip


def machine(plan: Plan) -> Json:
    import torch

    info: Json = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
    }
    import transformers

    info["transformers"] = transformers.__version__
    if plan.device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
