"""Run each block of a model spread over devices on the device that holds its weights.

accelerate's ``AlignDevicesHook`` (what ``dispatch_model`` and transformers' ``device_map``
install) moves a block's inputs to its execution device and, on a component's top module, the
outputs back to where the inputs came from. Its ``init_hook`` would also move the weights;
here the weight engine owns them (flat buffers per device, swapped on sleep and wake), so that
step is left out: weights are placed by the engine, never by a hook.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from accelerate.hooks import AlignDevicesHook, add_hook_to_module

from omnistage_worker.engine.placement import DeviceMap


class InputsToDevice(AlignDevicesHook):  # type: ignore[misc]
    """AlignDevicesHook without weight placement (the weight engine places the weights)."""

    def init_hook(self, module: torch.nn.Module) -> torch.nn.Module:
        return module


def attach(
    modules: Mapping[str, torch.nn.Module],
    execution: DeviceMap,
    devices: Sequence[torch.device],
) -> int:
    """Hook every block of ``execution`` to run on its device; the number of hooks attached.

    A component's top module gets ``io_same_device`` (its outputs come back to the caller's
    device). A single device needs no hooks.
    """
    if len(devices) < 2:
        return 0
    attached = 0
    for component, blocks in execution.items():
        module = modules[component]
        skip: Any = getattr(module, "_skip_keys_device_placement", None)
        top_device = devices[blocks.get("", _first(blocks))]
        top = InputsToDevice(execution_device=top_device, io_same_device=True, skip_keys=skip)
        add_hook_to_module(module, top)
        attached += 1
        for name, ordinal in blocks.items():
            if name == "":
                continue
            hook = InputsToDevice(execution_device=devices[ordinal], skip_keys=skip)
            add_hook_to_module(module.get_submodule(name), hook, append=True)
            attached += 1
    return attached


def _first(blocks: Mapping[str, int]) -> int:
    return next(iter(blocks.values()), 0)
