"""Device memory a model holds outside its registered parameters and buffers.

Plain attributes (a cached rotary table, a list of per-layer tensors) are found and moved to the
host with the weights, and back at wake. What the engine cannot move at all (static or hybrid KV
caches that transformers allocates per generate call, compiled graphs' private memory pools) is
refused when the engine is built, with the reason, rather than left behind after a sleep.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnistage_worker.engine.slots import skipped

UNMOVABLE_CACHES = ("static", "hybrid", "sliding_window", "offloaded_static", "mamba")


@dataclass
class AttributeTensor:
    """A tensor held in a plain attribute: ``owner.attr`` itself, or ``owner.attr[key]``."""

    owner: Any
    attr: str
    key: int | str | None
    tensor: torch.Tensor

    def put(self, tensor: torch.Tensor) -> None:
        """Rebind the attribute (or its element) to ``tensor``."""
        if self.key is None:
            object.__setattr__(self.owner, self.attr, tensor)
            return
        container = self.owner.__dict__[self.attr]
        if isinstance(container, tuple):
            items = list(container)
            items[int(self.key)] = tensor
            object.__setattr__(self.owner, self.attr, tuple(items))
        else:
            container[self.key] = tensor


def attribute_tensors(
    modules: Mapping[str, torch.nn.Module],
    device_type: str,
    skip: Collection[tuple[str, str]] = (),
) -> Iterator[AttributeTensor]:
    """Tensors on ``device_type`` in the modules' plain attributes (one container level deep);
    ``skip``: (component, submodule prefix) pairs owned by another component."""
    seen: set[int] = set()
    for component, module in modules.items():
        for prefix, sub in module.named_modules():
            if id(sub) in seen or (skip and skipped(component, prefix, skip)):
                continue
            seen.add(id(sub))
            for attr, value in list(vars(sub).items()):
                if attr in ("_parameters", "_buffers", "_modules"):
                    continue
                yield from _in_value(sub, attr, value, device_type)


def _in_value(owner: Any, attr: str, value: Any, device_type: str) -> Iterator[AttributeTensor]:
    if isinstance(value, torch.Tensor):
        if value.device.type == device_type and value.numel() > 0:
            yield AttributeTensor(owner, attr, None, value)
        return
    items: list[tuple[int | str, Any]]
    if isinstance(value, list | tuple):
        items = list(enumerate(value))
    elif isinstance(value, dict):
        items = [(k, v) for k, v in value.items() if isinstance(k, int | str)]
    else:
        return
    for key, item in items:
        if isinstance(item, torch.Tensor) and item.device.type == device_type and item.numel():
            yield AttributeTensor(owner, attr, key, item)


def unmovable(modules: Mapping[str, torch.nn.Module]) -> list[str]:
    """Why the engine cannot sleep these modules completely (empty: it can)."""
    reasons: list[str] = []
    for component, module in modules.items():
        for prefix, sub in module.named_modules():
            where = f"{component}.{prefix}" if prefix else component
            generation = getattr(sub, "generation_config", None)
            cache = getattr(generation, "cache_implementation", None)
            if cache in UNMOVABLE_CACHES:
                reasons.append(
                    f"{where}: generation_config.cache_implementation={cache!r} allocates KV "
                    "caches outside the weights that a sleep cannot move; use the dynamic cache"
                )
            if getattr(sub, "_compiled_call_impl", None) is not None:
                reasons.append(
                    f"{where}: compiled with torch.compile; its graphs' memory pools are not "
                    "moved by a sleep"
                )
    return reasons
