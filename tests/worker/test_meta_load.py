"""A causal LM built on ``meta`` and filled by the engine straight from its files (one copy).

The model must equal, bit for bit, what ``from_pretrained`` loads; a model the files cannot fill
directly (another dtype than the files') falls back to ``from_pretrained``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from omnistage_worker.config import WorkerConfig
from omnistage_worker.engine import WeightEngine
from omnistage_worker.runners.base import safetensors_in
from omnistage_worker.runners.causal_lm import CausalLMRunner
from omnistage_worker.runners.meta_model import build_on_meta

IDS = torch.tensor([[1, 5, 7, 9, 4, 6]])


def _runner(lm_dir: Path, dtype: str = "auto") -> CausalLMRunner:
    config = WorkerConfig(
        runner="ar", backend="transformers", model=lm_dir, host="127.0.0.1", port=0, dtype=dtype
    )
    return CausalLMRunner(config)


def _reference(lm_dir: Path) -> Any:
    model: Any = AutoModelForCausalLM.from_pretrained(str(lm_dir), local_files_only=True)
    model.eval()
    return model


def _assert_same(model: Any, reference: Any) -> None:
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert torch.equal(ours[name], tensor), name
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, reference(IDS).logits)


def test_built_on_meta_then_filled_from_the_files(lm_dir: Path) -> None:
    runner = _runner(lm_dir)
    runner.load()
    assert {p.device.type for p in runner.model.parameters()} == {"meta"}
    controller = runner.build_controller()
    controller.activate()
    assert {p.device.type for p in runner.model.parameters()} == {"cpu"}
    _assert_same(runner.model, _reference(lm_dir))
    assert runner.tokenizer is not None
    assert runner.model.generation_config.eos_token_id == runner.tokenizer.eos_token_id


@pytest.mark.parametrize("level", [1, 2])
def test_asleep_start_from_meta_wakes_to_the_same_model(lm_dir: Path, level: int) -> None:
    runner = _runner(lm_dir)
    runner.load()
    controller = runner.build_controller()
    controller.start_asleep(level)
    assert controller.device_bytes() == 0
    controller.wake()
    _assert_same(runner.model, _reference(lm_dir))
    controller.sleep(level)
    controller.wake()
    _assert_same(runner.model, _reference(lm_dir))


def test_other_dtype_than_the_files_loads_with_from_pretrained(lm_dir: Path) -> None:
    runner = _runner(lm_dir, dtype="bfloat16")  # the tiny model's files hold float32
    runner.load()
    assert {p.device.type for p in runner.model.parameters()} == {"cpu"}
    assert runner.model.dtype == torch.bfloat16
    runner.build_controller().activate()
    with torch.no_grad():
        assert runner.model(IDS).logits.shape[-1] == runner.model.config.vocab_size


def test_tied_embeddings_stay_one_tensor(tmp_path: Path) -> None:
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    LlamaForCausalLM(config).save_pretrained(str(tmp_path))
    files = safetensors_in(tmp_path)
    model = build_on_meta(tmp_path, torch.float32, files)
    assert model is not None
    assert model.lm_head.weight is model.model.embed_tokens.weight
    engine = WeightEngine({"model": model}, torch.device("cpu"), {"model": files})
    engine.activate()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.device.type == "cpu"
    _assert_same(model, _reference(tmp_path))
    engine.close()
