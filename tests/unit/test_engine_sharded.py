"""A model spread over two devices: the device map, one flat buffer per device, exact outputs.

CPU torch has one device, so the two devices are simulated: both shards' ``torch.device`` is
``cpu``, but each keeps its own flat buffer, host copy and byte accounting (what the simulated
GPU of each device charges), and the blocks run through the same input-moving hooks as on CUDA.
What is not simulated here: copies across a real PCIe link and two CUDA streams (bench/multi_gpu.py
measures those on the 2-GPU host).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from omnistage_worker.engine import hooks
from omnistage_worker.engine.flat_weights import EngineError
from omnistage_worker.engine.placement import (
    Block,
    blocks_of,
    execution_map,
    plan_device_map,
    split_contiguous,
)
from omnistage_worker.engine.sharded import ShardedEngine

CPU2 = [torch.device("cpu"), torch.device("cpu")]


def test_split_contiguous_balances_bytes_in_order() -> None:
    assert split_contiguous([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert split_contiguous([1, 100, 1, 1], 2) == [0, 0, 1, 1]
    assert split_contiguous([100, 1, 1, 1], 2) == [0, 1, 1, 1]
    assert split_contiguous([5, 5, 5], 3) == [0, 1, 2]
    # a large last block still leaves no device empty
    assert split_contiguous([1, 1, 1, 100], 2) == [0, 0, 0, 1]
    assert split_contiguous([7], 1) == [0]
    with pytest.raises(ValueError, match="cannot be spread"):
        split_contiguous([1], 2)


def test_device_map_over_whole_components() -> None:
    blocks = [Block("text_encoder", "", 10), Block("unet", "", 40), Block("vae", "", 10)]
    assert plan_device_map(blocks, 2) == {
        "text_encoder": {"": 0},
        "unet": {"": 0},
        "vae": {"": 1},
    }
    assert plan_device_map(blocks, 1) == {c: {"": 0} for c in ("text_encoder", "unet", "vae")}


def tiny_llama(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    return model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama-2dev")
    tiny_llama(tied=False).save_pretrained(path)
    return path


def logits(model: LlamaForCausalLM) -> torch.Tensor:
    ids = torch.arange(1, 17).reshape(1, 16)
    with torch.inference_mode():
        out: torch.Tensor = model(input_ids=ids).logits.clone()
    return out


def sharded(model: LlamaForCausalLM, files: Path | None = None) -> ShardedEngine:
    modules = {"model": model}
    device_map = plan_device_map(blocks_of(modules, no_split=model._no_split_modules), 2)
    weight_files = {"model": sorted(files.glob("*.safetensors"))} if files else None
    engine = ShardedEngine(modules, CPU2, device_map, weight_files)
    hooks.attach(modules, execution_map(engine.slots, device_map), CPU2)
    return engine


def test_decoder_layers_are_dealt_out_contiguously() -> None:
    model = tiny_llama(tied=False)
    blocks = blocks_of({"model": model}, no_split=model._no_split_modules)
    names = [b.name for b in blocks]
    assert "model.layers.0" in names and "model.layers.3" in names
    assert not any(n.startswith("model.layers.0.") for n in names)  # a layer is never split
    device_map = plan_device_map(blocks, 2)["model"]
    assert device_map["model.embed_tokens"] == 0
    assert device_map["lm_head"] == 1
    layers = [device_map[f"model.layers.{i}"] for i in range(4)]
    assert layers == sorted(layers) and set(layers) == {0, 1}


def test_each_device_gets_its_own_flat_buffer_and_outputs_stay_exact(llama_dir: Path) -> None:
    model = LlamaForCausalLM.from_pretrained(llama_dir)
    model.train(False)
    expected = logits(model)
    engine = sharded(model, llama_dir)
    engine.activate()
    per_device = [engine.device_bytes_on(i) for i in range(2)]
    assert all(b > 0 for b in per_device)
    assert sum(per_device) == engine.device_bytes() == engine.flat_bytes  # storages: padded
    assert torch.equal(logits(model), expected)
    for level in (1, 2, 1):
        stats = engine.sleep(level)
        assert [engine.device_bytes_on(i) for i in range(2)] == [0, 0]
        assert len(engine.last) == 2
        assert stats.bytes_moved == sum(s.bytes_moved for s in engine.last)
        if level == 1:  # each device's host copy is its own flat buffer
            assert [s.host_bytes() for s in engine.shards] == [s.flat_bytes for s in engine.shards]
        engine.wake()
        assert [engine.device_bytes_on(i) for i in range(2)] == per_device
        assert torch.equal(logits(model), expected)
    engine.close()


def test_a_tied_weight_lives_once_and_its_user_runs_where_it_is() -> None:
    model = tiny_llama(tied=True)
    expected = logits(model)
    modules = {"model": model}
    device_map = plan_device_map(blocks_of(modules, no_split=model._no_split_modules), 2)
    assert device_map["model"]["lm_head"] == 1
    engine = ShardedEngine(modules, CPU2, device_map)
    tied = [s for s in engine.slots if len(s.names) > 1]
    assert tied and all(s.ordinal == 0 for s in tied)  # the embedding's device
    assert execution_map(engine.slots, device_map)["model"]["lm_head"] == 0
    engine.activate()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    engine.sleep(1)
    engine.wake()
    assert torch.equal(logits(model), expected)
    engine.close()


def test_a_device_left_empty_is_refused() -> None:
    model = tiny_llama(tied=False)
    with pytest.raises(EngineError, match="leaves device 1"):
        ShardedEngine({"model": model}, CPU2, {"model": {"": 0}})


def test_a_device_that_fails_to_wake_leaves_every_device_asleep(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Device 1 cannot allocate its buffer: device 0's copy, already issued, is waited for and
    its new buffer given back; nothing woke, and the next wake brings the same outputs."""
    model = tiny_llama(tied=False)
    expected = logits(model)
    engine = sharded(model)
    engine.activate()
    engine.sleep(1)
    first, second = engine.shards
    real_new_flat = second._new_flat
    released: list[int] = []
    real_release = first._release_device

    def out_of_memory(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory (simulated on device 1)")

    def release() -> None:
        released.append(first.device_bytes())
        real_release()

    monkeypatch.setattr(second, "_new_flat", out_of_memory)
    monkeypatch.setattr(first, "_release_device", release)
    with pytest.raises(EngineError, match=r"device 1 \(cpu\): CUDA out of memory"):
        engine.wake()
    assert [s.level for s in engine.shards] == [1, 1]  # neither device woke
    assert released == [0] and engine.device_bytes() == 0
    engine.sleep(1)  # what the worker does after a failed wake: nothing left to do
    monkeypatch.setattr(second, "_new_flat", real_new_flat)
    engine.wake()
    assert [s.level for s in engine.shards] == [0, 0]
    assert torch.equal(logits(model), expected)
    engine.close()
