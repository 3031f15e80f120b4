"""The running batch's KV cache, kept in shapes that recur: rows and columns are allocated in
fixed buckets, so a decode step's attention sees the same few shapes again and again.

Why: with a padding mask, PyTorch's cuDNN attention builds a graph for each new shape (about
1 ms of host time per layer on an H200), and a cache that grows by a column per step (and
shrinks whenever a row ends) gives it a new shape at every step. Here the keys and values of
each layer live in one buffer ``[slots, heads, columns, dim]`` whose slot count is a row bucket
(:func:`row_bucket`) and whose column count is a multiple of :data:`COLUMN_BUCKET`; a step
writes its new columns in place at :attr:`BucketCache.at`, and the model attends over the whole
buffer through the explicit 4D mask of :meth:`BucketCache.attention` (unused columns and free
slots masked). A finished row frees its slot (a joining row takes it over, its past all masked),
and the buffer is laid out anew (:meth:`BucketCache.relayout`) only when a step would not fit,
when the batch has shrunk to half its slots, or when holes are compacted away.

A plain decode step (one column) writes through a device index (:class:`ColumnIndex`, one
per device the layers live on: a model split over GPUs writes each layer on its own device)
rather than a slice at a host integer, so the same kernels serve every column: what lets a
captured CUDA graph of the step (:mod:`.step_graphs`) be replayed while ``at`` moves on.

Attention over masked columns adds exactly nothing (their weight is zero), and a row still sees
only its own tokens at its own positions, so a request's tokens do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from omnistage_worker.runners.token_choice import to_device

COLUMN_BUCKET = 64
"""Columns are allocated in multiples of this."""
WIDTH_BUCKET = 8
"""A step that feeds prompts pads its width to a multiple of this (a plain step feeds 1)."""


def row_bucket(rows: int) -> int:
    """Slots for ``rows`` rows: 1, 2, 4, 8, then multiples of 8."""
    if rows <= 8:
        return 1 << max(0, rows - 1).bit_length()
    return -(-rows // 8) * 8


def column_bucket(columns: int) -> int:
    """Columns allocated for ``columns`` in use: a multiple of :data:`COLUMN_BUCKET`."""
    return max(1, -(-columns // COLUMN_BUCKET)) * COLUMN_BUCKET


def width_bucket(width: int) -> int:
    """A step's fed width: 1 stays 1 (a plain decode step), else a multiple of WIDTH_BUCKET."""
    return 1 if width <= 1 else -(-width // WIDTH_BUCKET) * WIDTH_BUCKET


class ColumnIndex:
    """The column a one-column step writes, as a one-element tensor on each device that asks
    for it (:meth:`on`); :meth:`fill` sets every copy. Layers keep this, not their cache."""

    def __init__(self, device: torch.device) -> None:
        self._at = 0
        first = torch.zeros(1, dtype=torch.long, device=device)
        self._by_device: dict[torch.device, torch.Tensor] = {first.device: first}
        self.first = first
        """The copy on the cache's own device (the one a captured step graph reads)."""

    def on(self, device: torch.device) -> torch.Tensor:
        """The copy on ``device`` (made at the current column the first time it is asked)."""
        copy = self._by_device.get(device)
        if copy is None:
            copy = torch.full((1,), self._at, dtype=torch.long, device=device)
            self._by_device[device] = copy
        return copy

    def fill(self, at: int) -> None:
        self._at = at
        for copy in self._by_device.values():
            copy.fill_(at)


class BucketLayer(CacheLayerMixin):  # type: ignore[no-untyped-call]
    """One layer's keys and values, ``[slots, heads, columns, dim]``, written in place at
    ``at`` (which its cache moves; the layer keeps no reference to the cache, so dropping the
    cache frees its buffers at once, without waiting for Python's cycle collector). A
    one-column write goes to the column ``column`` holds (on the layer's own device; the
    cache fills it), so its kernels do not depend on ``at``."""

    is_sliding = False
    is_compileable = False

    def __init__(self, slots: int, columns: int, at: int, column: ColumnIndex) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.slots, self.columns, self.at = slots, columns, at
        self.column = column

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        for name, states in (("keys", key_states), ("values", value_states)):
            heads, dim = states.shape[1], states.shape[3]
            setattr(self, name, states.new_zeros((self.slots, heads, self.columns, dim)))
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        at, width = self.at, key_states.shape[2]
        if width == 1:
            column = self.column.on(self.keys.device)
            self.keys.index_copy_(2, column, key_states)
            self.values.index_copy_(2, column, value_states)
        else:
            self.keys[:, :, at : at + width] = key_states
            self.values[:, :, at : at + width] = value_states
        return self.keys, self.values

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.columns, 0

    def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
        return self.at

    def get_max_length(self) -> int:
        return self.columns


class BucketCache(Cache):
    """The batch's cache: ``slots`` rows by ``columns`` columns per layer, a ``[slots, columns]``
    mask of the tokens each slot holds, and ``at``: the first column not yet written (for a
    one-column step also in ``column``, a :class:`ColumnIndex`). ``graph``: the captured plain step
    that runs on this cache's buffers, if any (:mod:`.step_graphs`; it goes with the cache)."""

    def __init__(self, slots: int, columns: int, device: torch.device, additive: bool) -> None:
        super().__init__(layers=[])
        self.own: list[BucketLayer] = []
        """The layers (``layers`` as this class types them)."""
        self.slots, self.columns, self.at = slots, columns, 0
        self.mask = torch.zeros((slots, columns), dtype=torch.bool, device=device)
        self._additive = additive
        self._columns_index = torch.arange(columns, device=device)
        self.column = ColumnIndex(device)
        self.plain_steps = 0
        """One-column steps run on this cache."""
        self.graph: Any = None

    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        while len(self.own) <= layer_idx:
            self._add(BucketLayer(self.slots, self.columns, self.at, self.column))
        return self.own[layer_idx].update(key_states, value_states)

    def _add(self, layer: BucketLayer) -> None:
        self.own.append(layer)
        self.layers.append(layer)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.at

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.columns, 0

    def fits(self, width: int) -> bool:
        """Whether a step feeding ``width`` columns fits without a new layout."""
        return self.at + width <= self.columns

    def clear(self, slots: Sequence[int]) -> None:
        """Mask out everything ``slots`` held (they are free, or a new row takes them)."""
        for slot in slots:  # a fill each (no index to copy up: the host does not wait)
            self.mask[slot] = False

    def attention(self, fed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Write the step's fed-token mask ``fed`` ``[slots, width]`` at ``at``; the step's 4D
        mask ``[slots, 1, width, columns]``: each fed position sees its slot's tokens up to and
        including its own column (a padding position sees only itself, so no row of the
        attention is empty)."""
        width = fed.shape[1]
        if width == 1:
            self.column.fill(self.at)
        self.mask[:, self.at : self.at + width] = fed
        columns = self._columns_index
        own = self.at + torch.arange(width, device=columns.device)
        causal = columns[None, :] <= own[:, None]
        itself = columns[None, :] == own[:, None]
        allowed = (self.mask[:, None, None, :] & causal) | itself
        if not self._additive:
            return allowed
        blocked = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return blocked.masked_fill(~allowed, torch.finfo(dtype).min)

    def advance(self, width: int) -> None:
        self.at += width
        for layer in self.own:
            layer.at = self.at

    def nbytes(self) -> int:
        """Bytes of the buffers and the mask."""
        total = self.mask.numel() * self.mask.element_size()
        for layer in self.own:
            for tensor in (layer.keys, layer.values):
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

    def relayout(
        self,
        keep: Sequence[int],
        firsts: Sequence[int],
        seen: Sequence[int],
        *,
        rows: int,
        width: int,
        compact: bool,
        spare: int = 0,
    ) -> tuple[BucketCache, list[int]]:
        """A new cache holding the slots ``keep`` (in that order, as slots 0..) with room for
        ``rows`` rows and a step of ``width`` columns. ``firsts``: each kept slot's first column;
        ``seen``: its tokens; ``spare``: columns of room wanted beyond the step. Columns no
        kept slot uses are dropped; with ``compact`` the holes joins left inside the rows go too
        (each slot's tokens move to the right end). Returns
        the cache and each kept slot's first column in it."""
        device = self.mask.device
        index = to_device(torch.tensor(list(keep)), device)
        mask = self.mask.index_select(0, index)
        start = min(firsts)
        longest = max(seen)
        if compact:
            # Stable: a slot's padding columns first, then its tokens in their order.
            order = torch.argsort(mask.to(torch.int8), dim=1, stable=True)[:, -longest:]
            used = longest
            new_firsts = [longest - s for s in seen]
        else:
            order = None
            used = self.at - start
            new_firsts = [f - start for f in firsts]
        cache = BucketCache(
            row_bucket(rows), column_bucket(used + width + spare), device, self._additive
        )
        kept = len(keep)

        def moved(tensor: torch.Tensor) -> torch.Tensor:
            tensor = tensor.index_select(0, index)
            if order is None:
                return tensor[:, :, start : self.at]
            spread = order[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            return tensor.gather(2, spread)

        kept_mask = mask[:, start : self.at] if order is None else mask.gather(1, order)
        cache.mask[:kept, :used] = kept_mask
        for layer in self.own:
            new = BucketLayer(cache.slots, cache.columns, used, cache.column)
            assert layer.keys is not None and layer.values is not None
            for name in ("keys", "values"):
                old: torch.Tensor = getattr(layer, name)
                buffer = old.new_zeros((cache.slots, old.shape[1], cache.columns, old.shape[3]))
                buffer[:kept, :, :used] = moved(old)
                setattr(new, name, buffer)
            new.is_initialized = True
            cache._add(new)
        cache.at = used
        return cache, new_firsts
