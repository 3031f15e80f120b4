"""The batch's bucketed KV cache (runners/kv_buckets.py) on a model split over devices.

A model placed over several GPUs (``--gpus 2``) runs each decoder layer on its own device, so
a one-column write must index on the layer's device: seen on 2 x H200, where a column index
kept on cuda:0 failed the first step of a layer on cuda:1 (and so the worker's load). Here the
second device is PyTorch's ``meta`` device; it does not check that an op's tensors share a
device as CUDA's kernels do, so a dispatch mode records every ``index_copy_`` and the test
checks that rule itself."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from omnistage_worker.runners.kv_buckets import BucketCache


def _states(device: str, value: float) -> torch.Tensor:
    return torch.full((2, 1, 1, 4), value, device=device)  # [slots, heads, width 1, dim]


class IndexCopies(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Records the devices of every ``index_copy_``'s tensors."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.devices: list[set[str]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten.index_copy_.default:
            self.devices.append({str(a.device) for a in args if isinstance(a, torch.Tensor)})
        return func(*args, **(kwargs or {}))


def test_a_one_column_step_writes_each_layer_on_its_own_device() -> None:
    cache = BucketCache(2, 64, torch.device("cpu"), additive=False)
    copies = IndexCopies()
    with copies:
        for column in range(2):
            cache.attention(torch.ones((2, 1), dtype=torch.bool), torch.float32)
            cache.update(_states("cpu", column + 1.0), _states("cpu", column + 1.0), 0)
            keys, _ = cache.update(_states("meta", 1.0), _states("meta", 1.0), 1)
            assert keys.device.type == "meta"
            cache.advance(1)
    assert copies.devices == [{"cpu"}, {"cpu"}, {"meta"}, {"meta"}] * 2
    first = cache.own[0].keys
    assert first is not None
    assert first[:, 0, :3, 0].tolist() == [[1.0, 2.0, 0.0]] * 2  # each step at its column
    first = cache.own[0].keys
    assert first is not None
    assert first[:, 0, :2, 0].tolist() == [[1.0, 2.0], [1.0, 2.0]]  # each step at its column


def test_a_device_asking_late_gets_the_current_column() -> None:
    cache = BucketCache(1, 64, torch.device("cpu"), additive=False)
    cache.advance(5)
    cache.attention(torch.ones((1, 1), dtype=torch.bool), torch.float32)
    assert int(cache.column.first.item()) == 5
    late = cache.column.on(torch.device("cpu"))
    assert late is cache.column.first  # the cache's own device: the one copy
