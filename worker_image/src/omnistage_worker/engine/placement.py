"""Which of a stage's devices holds which weights: a device map over whole blocks.

A stage with ``gpus: N`` runs its model in ONE process across N devices (pipeline style, as
accelerate's ``device_map`` does): the model is cut into blocks that are never split (a decoder
layer, an embedding, a whole diffusers component), the blocks are dealt out in order so that
each device holds a contiguous run of about ``1/N`` of the bytes, and each block runs on the
device that holds its weights (inputs follow it, see :mod:`.hooks`). A tied weight lives where
its first binding's block is; a block that only uses it runs there too.

Pure logic: sizes and names in, a map out; no device work.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from omnistage_worker.engine.slots import Slot

DeviceMap = Mapping[str, Mapping[str, int]]
"""Per component, block name (a module's qualified name, "" for the whole) -> device ordinal."""


@dataclass(frozen=True)
class Block:
    """A run of weights that stays on one device: component, module name, bytes."""

    component: str
    name: str
    nbytes: int


def split_contiguous(sizes: Sequence[int], parts: int) -> list[int]:
    """Deal ``sizes`` out in order to ``parts`` devices; each gets about ``1/parts`` of the sum.

    Returns the ordinal of each item. A block starts a new device once the devices so far would
    hold more than their share with it; no device is left empty while items remain for it.
    """
    if parts < 1:
        raise ValueError(f"parts must be at least 1, got {parts}")
    if len(sizes) < parts:
        raise ValueError(f"{len(sizes)} blocks cannot be spread over {parts} devices")
    total = sum(sizes)
    out: list[int] = []
    ordinal, done, here = 0, 0, 0
    for i, size in enumerate(sizes):
        later_devices = parts - 1 - ordinal
        must_move = len(sizes) - i <= later_devices  # the rest must each start a device
        past_share = done + size / 2 > total * (ordinal + 1) / parts
        if here and later_devices and (must_move or past_share):
            ordinal, here = ordinal + 1, 0
        out.append(ordinal)
        done, here = done + size, here + 1
    return out


def blocks_of(
    modules: Mapping[str, torch.nn.Module], no_split: Iterable[str] = (), whole: bool = False
) -> list[Block]:
    """The blocks of every component, in module order.

    ``whole``: each component is one block (diffusers pipelines: components pass tensors in
    pipeline code). Otherwise a module is a block when its class is in ``no_split`` or it has
    no children; a module's own parameters (beside its children's) form a block of their own.
    """
    keep = set(no_split)
    out: list[Block] = []
    for component, module in modules.items():
        if whole:
            out.append(Block(component, "", _bytes(module, recurse=True)))
            continue
        out.extend(_walk(component, module, "", keep))
    return out


def _walk(component: str, module: torch.nn.Module, prefix: str, keep: set[str]) -> list[Block]:
    children = list(module.named_children())
    if not children or type(module).__name__ in keep:
        size = _bytes(module, recurse=True)
        return [Block(component, prefix, size)] if size else []
    out: list[Block] = []
    own = _bytes(module, recurse=False)
    if own:
        out.append(Block(component, prefix, own))
    for name, child in children:
        out.extend(_walk(component, child, f"{prefix}.{name}" if prefix else name, keep))
    return out


def _bytes(module: torch.nn.Module, recurse: bool) -> int:
    seen: dict[int, int] = {}
    for tensor in [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]:
        seen[id(tensor)] = tensor.numel() * tensor.element_size()
    return sum(seen.values())


def plan_device_map(blocks: Sequence[Block], devices: int) -> dict[str, dict[str, int]]:
    """A device map dealing ``blocks`` out contiguously over ``devices`` devices."""
    ordinals = split_contiguous([b.nbytes for b in blocks], devices) if devices > 1 else None
    out: dict[str, dict[str, int]] = {}
    for i, block in enumerate(blocks):
        out.setdefault(block.component, {})[block.name] = 0 if ordinals is None else ordinals[i]
    return out


def block_of(component: str, name: str, device_map: DeviceMap) -> str | None:
    """The longest block name of ``component`` that contains the tensor ``name``."""
    best: str | None = None
    for prefix in device_map.get(component, {}):
        inside = prefix in ("", name) or name.startswith(prefix + ".")
        if inside and (best is None or len(prefix) > len(best)):
            best = prefix
    return best


def ordinal_of(component: str, name: str, device_map: DeviceMap) -> int:
    """The ordinal of the block that holds the tensor ``component``/``name`` (0 when none)."""
    block = block_of(component, name, device_map)
    return 0 if block is None else device_map[component][block]


def assign_ordinals(slots: Iterable[Slot], device_map: DeviceMap) -> None:
    """Set each slot's ``ordinal``: where its first binding's block is (tied weights: once)."""
    for slot in slots:
        component, name = slot.names[0]
        slot.ordinal = ordinal_of(component, name, device_map)


def execution_map(slots: Iterable[Slot], device_map: DeviceMap) -> dict[str, dict[str, int]]:
    """Where each block runs: the device of the first weight bound in it (tied ones included).

    A block whose weights are all tied to a block on another device (``lm_head`` tied to the
    embedding) runs on that device, so it never reads a weight across devices.
    """
    first: dict[tuple[str, str], int] = {}
    for slot in sorted(slots, key=lambda s: s.key):
        for component, name in slot.names:
            block = block_of(component, name, device_map)
            if block is not None:
                first.setdefault((component, block), slot.ordinal)
    return {
        component: {block: first.get((component, block), ordinal) for block, ordinal in m.items()}
        for component, m in device_map.items()
    }
