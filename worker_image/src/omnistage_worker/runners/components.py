"""A pipeline's components: discovered from its modules, or declared by dotted paths.

vLLM-Omni lets a pipeline declare its DiT, encoder and VAE modules so offloading finds them under
any attribute name; here a declared list (``--components``) names attribute paths from the
pipeline (``transformer``, ``text_encoder_2``, ``prior.text_encoder``). Declared components come
first; every other ``nn.Module`` component of the pipeline is discovered and added after them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch


class ComponentError(ValueError):
    """A declared component path does not name a module of the pipeline."""


def resolve_path(root: Any, path: str) -> torch.nn.Module:
    """The module at ``path`` (dotted attributes; a number indexes a list or ModuleList)."""
    node = root
    for part in path.split("."):
        if part.isdigit() and isinstance(node, Sequence | torch.nn.ModuleList):
            node = node[int(part)]
        elif hasattr(node, part):
            node = getattr(node, part)
        else:
            raise ComponentError(f"{type(root).__name__} has no {path!r} (no {part!r})")
    if not isinstance(node, torch.nn.Module):
        raise ComponentError(f"{path!r} is a {type(node).__name__}, not a torch module")
    return node


def discover(
    pipeline: Any, modules: Mapping[str, torch.nn.Module], declared: Sequence[str] = ()
) -> dict[str, torch.nn.Module]:
    """Declared components, then the pipeline's other ``modules`` (one name per module)."""
    found = {path: resolve_path(pipeline, path) for path in declared}
    taken = {id(m) for m in found.values()}
    for name, module in modules.items():
        if id(module) not in taken:
            found[name] = module
            taken.add(id(module))
    return found
