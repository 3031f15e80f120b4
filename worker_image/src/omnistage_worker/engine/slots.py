"""Discovery of a model's distinct tensors (parameters and buffers) and where they are bound."""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field

import torch

from omnistage_worker.engine.safetensors_index import DTYPE_SIZES, TensorEntry

TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.float32: "F32",
    torch.int64: "I64",
    torch.float64: "F64",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e4m3fn: "F8_E4M3",
}


@dataclass
class Slot:
    """One distinct tensor of the model, with every Parameter/buffer object that shares it."""

    key: int
    names: list[tuple[str, str]]
    """(component, qualified name) of every binding, e.g. ("unet", "conv_in.weight")."""
    dtype: torch.dtype
    shape: torch.Size
    nbytes: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    """The Parameter/buffer objects; the engine swaps their ``.data``."""
    entry: TensorEntry | None = None
    """Where a level-2 wake reads the bytes from; None means they are kept on the host."""
    ordinal: int = 0
    """Which of the stage's devices holds it (0..gpus-1; see :mod:`.placement`)."""


def skipped(component: str, prefix: str, skip: Collection[tuple[str, str]]) -> bool:
    """Whether submodule ``prefix`` of ``component`` lies in a skipped (component, prefix)."""
    return any(c == component and (prefix == p or prefix.startswith(p + ".")) for c, p in skip)


def iter_bindings(
    modules: Mapping[str, torch.nn.Module],
    skip: Collection[tuple[str, str]] = (),
) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (component, qualified name, tensor) for every parameter and buffer, aliases too;
    ``skip``: (component, submodule prefix) pairs owned by another component."""
    for component, module in modules.items():
        for prefix, sub in module.named_modules(remove_duplicate=False):
            if skip and skipped(component, prefix, skip):
                continue
            tables: list[Mapping[str, torch.Tensor | None]] = [sub._parameters, sub._buffers]
            for table in tables:
                for attr, tensor in table.items():
                    if tensor is None:
                        continue
                    yield component, f"{prefix}.{attr}" if prefix else attr, tensor


def _identity(tensor: torch.Tensor) -> tuple[object, ...]:
    """Key that is equal for objects that are, or view exactly, the same tensor."""
    if tensor.numel() == 0 or tensor.device.type == "meta":
        return ("object", id(tensor))
    return (
        "memory",
        tensor.device.type,
        tensor.data_ptr(),
        tensor.dtype,
        tuple(tensor.shape),
        tuple(tensor.stride()),
    )


def collect_slots(
    modules: Mapping[str, torch.nn.Module], skip: Collection[tuple[str, str]] = ()
) -> list[Slot]:
    """Group every binding into distinct slots (tied weights share one slot)."""
    by_identity: dict[tuple[object, ...], Slot] = {}
    by_object: dict[int, Slot] = {}
    slots: list[Slot] = []
    for component, name, tensor in iter_bindings(modules, skip):
        slot = by_object.get(id(tensor)) or by_identity.get(_identity(tensor))
        if slot is None:
            slot = Slot(
                key=len(slots),
                names=[],
                dtype=tensor.dtype,
                shape=tensor.shape,
                nbytes=tensor.numel() * tensor.element_size(),
            )
            slots.append(slot)
            by_identity[_identity(tensor)] = slot
        slot.names.append((component, name))
        if all(t is not tensor for t in slot.tensors):
            slot.tensors.append(tensor)
        by_object[id(tensor)] = slot
    return slots


def match_entry(slot: Slot, index: Mapping[str, Mapping[str, TensorEntry]]) -> TensorEntry | None:
    """The file entry holding this slot's bytes: same name, shape, and exact byte size."""
    for component, name in slot.names:
        entry = index.get(component, {}).get(name)
        if entry is None or entry.shape != tuple(slot.shape):
            continue
        if TORCH_TO_SAFETENSORS.get(slot.dtype) != entry.dtype:
            continue
        if DTYPE_SIZES[entry.dtype] * _numel(entry.shape) != slot.nbytes:
            continue
        return entry
    return None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def rebind(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """Make ``tensor`` (a Parameter or buffer object, kept by identity) hold ``data``.

    A ``meta`` tensor (a model built without memory) cannot take other data through ``.data``:
    its object is swapped in place with one holding ``data`` (same Python object afterwards).
    """
    if tensor.device.type != "meta":
        tensor.data = data
        return
    replacement: torch.Tensor = data.detach()
    if isinstance(tensor, torch.nn.Parameter):
        replacement = torch.nn.Parameter(data, requires_grad=tensor.requires_grad)
    torch.utils.swap_tensors(tensor, replacement)  # type: ignore[no-untyped-call]
