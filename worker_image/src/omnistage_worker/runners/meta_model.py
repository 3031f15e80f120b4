"""A causal LM built with its parameters on the ``meta`` device, for the engine to fill from files.

``from_pretrained`` reads every weight into host memory, and the weight engine then copies it once
more into the device's flat buffer. Built here instead: the model's class from its config, its
parameters on ``meta`` (no memory, no initialisation) and its buffers computed on the CPU as the
model's own ``__init__`` does (rotary tables); the weight engine then reads the safetensors bytes
straight into the flat buffer (:mod:`omnistage_worker.engine.reload`), one copy instead of two.

Taken only when every parameter has its file entry (same name, shape and dtype; tied weights
share one) and no persistent buffer is stored in the files; otherwise :func:`build_on_meta`
returns None with the reason, and the caller loads with ``from_pretrained`` (a model whose
loading renames or converts weights, or a ``--dtype`` other than the files').
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage_worker.engine.safetensors_index import TensorEntry, read_indexes
from omnistage_worker.engine.slots import collect_slots, match_entry

log = logging.getLogger(__name__)


def unmatched(model: torch.nn.Module, index: dict[str, TensorEntry]) -> str | None:
    """Why ``model`` cannot be filled from ``index`` alone (None: it can)."""
    persistent = {name for name, _ in model.named_buffers()} & set(model.state_dict())
    stored = sorted(persistent & set(index))
    if stored:
        return f"persistent buffers stored in the files: {', '.join(stored[:3])}"
    for slot in collect_slots({"model": model}):
        if slot.tensors[0].device.type != "meta":
            continue
        if match_entry(slot, {"model": index}) is None:
            name = slot.names[0][1]
            entry = index.get(name)
            found = "absent" if entry is None else f"{entry.dtype} {list(entry.shape)} in the file"
            return f"{name} ({slot.dtype}, {list(slot.shape)}): {found}"
    return None


def build_on_meta(model_dir: Path, dtype: torch.dtype | None, files: Sequence[Path]) -> Any | None:
    """The model of ``model_dir`` with meta parameters, or None (logged) when its files cannot
    fill it directly."""
    if not files:
        return None
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(model_dir), local_files_only=True)
    with init_empty_weights(include_buffers=False):
        model: Any = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
            config, dtype=dtype
        )
    model.tie_weights()  # as from_pretrained does after loading (tied: one tensor, one entry)
    reason = unmatched(model, read_indexes(files))
    if reason is not None:
        log.info("not reading the weights straight from the files (%s): from_pretrained", reason)
        return None
    if (model_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(
            str(model_dir), local_files_only=True
        )
    model.eval()
    return model
