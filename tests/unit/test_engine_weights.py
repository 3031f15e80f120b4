"""The sleep engine on CPU with a real tiny Llama in safetensors: exact bytes, exact outputs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from omnistage_worker.engine import EngineError, WeightEngine


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def load(path: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM)
    model.train(False)
    return model


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.inference_mode():
        out: torch.Tensor = model(input_ids=ids).logits.clone()
    return out


def make_engine(path: Path, model: LlamaForCausalLM) -> WeightEngine:
    files = {"model": sorted(path.glob("*.safetensors"))}
    return WeightEngine({"model": model}, torch.device("cpu"), files)


def test_sleep_wake_cycles_are_bit_identical_and_account_exactly(llama_dir: Path) -> None:
    model = load(llama_dir)
    engine = make_engine(llama_dir, model)
    engine.activate()
    before = logits(model)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert engine.device_bytes() == engine.flat_bytes
    assert engine.file_backed_bytes > 0.99 * engine.weights_bytes

    for level in (1, 2, 1, 2):
        stats = engine.sleep(level)
        assert not stats.noop
        assert engine.device_bytes() == 0, f"level {level} sleep left weights on the device"
        if level == 1:
            assert engine.host_bytes() >= engine.weights_bytes
        else:
            assert engine.host_bytes() == engine.host_kept_bytes < 0.01 * engine.weights_bytes
        woke = engine.wake()
        assert woke.bytes_moved >= engine.weights_bytes - engine.host_kept_bytes
        assert engine.device_bytes() == engine.flat_bytes
        assert torch.equal(logits(model), before), f"output changed after a level-{level} cycle"
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_level_changes_and_noops(llama_dir: Path) -> None:
    engine = make_engine(llama_dir, load(llama_dir))
    engine.activate()
    assert engine.wake().noop
    engine.sleep(1)
    assert engine.sleep(1).noop
    engine.sleep(2)  # 1 -> 2 drops the host copy
    assert engine.host_bytes() == engine.host_kept_bytes
    with pytest.raises(EngineError, match="level 2 to level 1"):
        engine.sleep(1)
    with pytest.raises(EngineError, match="1 or 2"):
        engine.sleep(3)


@pytest.mark.parametrize("level", [1, 2])
def test_start_asleep_takes_no_device_memory(llama_dir: Path, level: int) -> None:
    reference = load(llama_dir)
    expected = logits(reference)
    model = load(llama_dir)
    engine = make_engine(llama_dir, model)
    engine.start_asleep(level)
    assert engine.device_bytes() == 0
    assert engine.level == level
    engine.wake()
    assert torch.equal(logits(model), expected)


def test_level_two_needs_files(llama_dir: Path) -> None:
    engine = WeightEngine({"model": load(llama_dir)}, torch.device("cpu"), None)
    engine.activate()
    with pytest.raises(EngineError, match="safetensors"):
        engine.sleep(2)


def test_tensors_rewritten_at_load_are_kept_not_reloaded(llama_dir: Path) -> None:
    model = load(llama_dir)
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)  # the live weight no longer matches its file
    expected = logits(model)
    engine = make_engine(llama_dir, model)
    engine.activate()
    assert engine.sleep(2).bytes_moved >= model.model.norm.weight.numel() * 4
    engine.wake()
    assert torch.equal(logits(model), expected)
