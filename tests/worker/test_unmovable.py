"""Device memory outside registered parameters and buffers: plain attributes are found and moved
with the weights; what the engine cannot move is refused when the engine is built."""

from __future__ import annotations

import pytest
import torch

from omnistage_worker.engine import EngineError, WeightEngine
from omnistage_worker.engine.attributes import attribute_tensors, unmovable


class Cached(torch.nn.Module):
    """A layer that keeps plain-attribute caches (a rotary table, per-layer lists)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.table = torch.arange(6.0)
        self.per_layer = [torch.ones(2), torch.zeros(3)]
        self.by_name = {"k": torch.full((2,), 7.0)}
        self.pair = (torch.ones(1), torch.ones(5))


def test_plain_attributes_found_and_rebound() -> None:
    module = Cached()
    found = list(attribute_tensors({"m": module}, "cpu"))
    where = {(f.attr, f.key) for f in found}
    assert where == {
        ("table", None),
        ("per_layer", 0),
        ("per_layer", 1),
        ("by_name", "k"),
        ("pair", 0),
        ("pair", 1),
    }
    for f in found:
        f.put(f.tensor * 0 - 1)
    assert module.table.eq(-1).all() and module.per_layer[1].eq(-1).all()
    assert module.by_name["k"].eq(-1).all() and module.pair[1].eq(-1).all()
    assert isinstance(module.pair, tuple)


def test_unmovable_caches_refused_at_load() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = LlamaForCausalLM(config)
    assert unmovable({"model": model}) == []
    model.generation_config.cache_implementation = "static"
    with pytest.raises(EngineError, match=r"cache_implementation='static' allocates KV caches"):
        WeightEngine({"model": model}, torch.device("cpu"))


def test_compiled_module_refused_at_load() -> None:
    layer = torch.nn.Linear(2, 2)
    layer.compile()
    with pytest.raises(EngineError, match=r"compiled with torch\.compile"):
        WeightEngine({"m": layer}, torch.device("cpu"))
