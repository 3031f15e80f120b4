"""Component-level sleep: a pipeline's components (DiT/UNet, text encoders, VAE), each with its own
slice of the engine's buffers, put to sleep and woken separately.

Components are a grouping over the model's slots: components that share a tensor form one group
(they can only move together); a component nested inside another (a declared dotted path) is
skipped by its parent's slots. Each group is a :class:`WeightEngine` of its own: its own flat
device buffer, page-locked host copy and file reloads, so sleeping the text encoders frees their
bytes while the transformer stays bound.

Sequential mode keeps one group resident at a time inside a request: a forward (or a VAE's
``encode``/``decode``) of a component that is asleep first puts the resident group to sleep at
level 1 (its pinned host copy; requests only read the weights, so a copy still valid is not
written again) and wakes this one, so the footprint is the largest group's.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from omnistage_worker.engine.copy_jobs import CopyJob, JobError, run_jobs
from omnistage_worker.engine.flat_weights import EngineError, WeightFiles
from omnistage_worker.engine.slots import iter_bindings
from omnistage_worker.engine.vmm import PiecesFactory
from omnistage_worker.engine.weights import TransferStats, WeightEngine

log = logging.getLogger(__name__)

SEQUENTIAL_METHODS = ("encode", "decode")
"""Methods pipelines call on a component directly (not through ``forward``): the VAE's."""


@dataclass(frozen=True)
class Group:
    """Components that move together, and the (component, submodule) pairs they skip."""

    names: tuple[str, ...]
    skip: tuple[tuple[str, str], ...]

    @property
    def name(self) -> str:
        return "+".join(self.names)


@dataclass(frozen=True)
class ComponentFigures:
    """One group's weights, what of them is on the device, and its sleep level (0: resident)."""

    name: str
    weights_bytes: int
    device_bytes: int
    level: int


def _skips(names: Collection[str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """Per component, the nested components inside it (as (component, submodule prefix))."""
    return {
        outer: tuple(
            (outer, inner[len(outer) + 1 :]) for inner in names if inner.startswith(outer + ".")
        )
        for outer in names
    }


def plan_groups(components: Mapping[str, torch.nn.Module]) -> list[Group]:
    """Groups of components: those sharing a tensor's storage are merged (order kept)."""
    skips = _skips(list(components))
    owner: dict[str, str] = {n: n for n in components}

    def find(name: str) -> str:
        while owner[name] != name:
            name = owner[name]
        return name

    storages: dict[tuple[str, int], str] = {}
    for name, module in components.items():
        for _, _, tensor in iter_bindings({name: module}, skips[name]):
            if tensor.numel() == 0 or tensor.device.type == "meta":
                continue
            key = (tensor.device.type, tensor.untyped_storage().data_ptr())
            other = storages.setdefault(key, name)
            if find(other) != find(name):
                owner[find(name)] = find(other)
    members: dict[str, list[str]] = {}
    for name in components:
        members.setdefault(find(name), []).append(name)
    return [
        Group(tuple(names), tuple(s for n in names for s in skips[n])) for names in members.values()
    ]


def _sum(stats: Iterable[TransferStats], started: float) -> TransferStats:
    items = list(stats)
    return TransferStats(
        sum(s.bytes_moved for s in items),
        time.perf_counter() - started,
        noop=all(s.noop for s in items),
    )


class ComponentEngine:
    """The sleep controller of a pipeline whose components sleep separately."""

    def __init__(
        self,
        components: Mapping[str, torch.nn.Module],
        device: torch.device,
        files: WeightFiles | None = None,
        *,
        host_copy: bool = True,
        sequential: bool = False,
        pin_in_background: bool = True,
        device_pieces: PiecesFactory | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.sequential = sequential
        self.engines: dict[str, WeightEngine] = {}
        self._group_of: dict[str, str] = {}
        for group in plan_groups(components):
            modules = {n: components[n] for n in group.names}
            if not any(True for _ in iter_bindings(modules, group.skip)):
                log.info("component %s holds no weights: not managed", group.name)
                continue
            group_files = None
            if files is not None:
                group_files = {n: files[n] for n in group.names if n in files}
            self.engines[group.name] = WeightEngine(
                modules,
                self.device,
                group_files,
                host_copy=host_copy or sequential,
                skip=group.skip,
                pin_in_background=pin_in_background,
                device_pieces=device_pieces,
            )
            for n in group.names:
                self._group_of[n] = group.name
        if not self.engines:
            raise EngineError("the model has no parameters or buffers")
        self._modules = dict(components)
        self._hooks: list[Any] = []

    # ---- SleepController -----------------------------------------------------------------

    @property
    def level(self) -> int:
        """0 while any group is resident; else the deepest group's level."""
        levels = [e.level for e in self.engines.values()]
        return 0 if 0 in levels else max(levels)

    @property
    def weights_bytes(self) -> int:
        return sum(e.weights_bytes for e in self.engines.values())

    @property
    def flat_bytes(self) -> int:
        """What waking every group allocates (sequential: the largest group's buffer)."""
        sizes = [e.flat_bytes for e in self.engines.values()]
        return max(sizes) if self.sequential else sum(sizes)

    def device_bytes(self) -> int:
        return sum(e.device_bytes() for e in self.engines.values())

    def host_bytes(self) -> int:
        return sum(e.host_bytes() for e in self.engines.values())

    def activate(self) -> TransferStats:
        """Place every group on the device (sequential: only the largest; the rest asleep)."""
        started = time.perf_counter()
        if not self.sequential:
            return _sum((e.activate() for e in self.engines.values()), started)
        stats = [e.start_asleep(1) for e in self.engines.values()]
        stats.append(self.engines[self._largest()].wake())
        self._install_hooks()
        return _sum(stats, started)

    def start_asleep(self, level: int) -> TransferStats:
        started = time.perf_counter()
        stats = _sum((e.start_asleep(level) for e in self.engines.values()), started)
        if self.sequential:
            self._install_hooks()
        return stats

    def sleep(self, level: int) -> TransferStats:
        """Every group to ``level`` (groups already there are left as they are)."""
        return self._sleep_groups(list(self.engines), level)

    def wake(self) -> TransferStats:
        """Every group resident (sequential: the largest; the others stay at level 1)."""
        started = time.perf_counter()
        if self.sequential:
            for name, engine in self.engines.items():
                if engine.level == 2 and name != self._largest():
                    engine.wake()  # reload, then park on the host: requests swap from there
                    engine.sleep(1)
            return _sum([self.engines[self._largest()].wake()], started)
        return self._wake_groups(list(self.engines), started)

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        for engine in self.engines.values():
            engine.close()

    # ---- components ----------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        """The groups' names (a group of one component is named as the component)."""
        return list(self.engines)

    def resolve(self, names: Iterable[str]) -> list[str]:
        """The groups holding the named components (or groups); EngineError for unknown ones."""
        groups: list[str] = []
        for name in names:
            group = self._group_of.get(name) or (name if name in self.engines else None)
            if group is None:
                known = ", ".join(self.engines)
                raise EngineError(f"unknown component {name!r} (known: {known})")
            if group not in groups:
                groups.append(group)
        return groups

    def sleep_components(self, names: Iterable[str], level: int) -> TransferStats:
        """Put the named components' groups to sleep at ``level``; the others stay as they are."""
        return self._sleep_groups(self.resolve(names), level)

    def wake_components(self, names: Iterable[str]) -> TransferStats:
        return self._wake_groups(self.resolve(names), time.perf_counter())

    def _sleep_groups(self, groups: list[str], level: int) -> TransferStats:
        """``groups`` to ``level``; at level 1 from awake, their copies issued together (one
        :func:`run_jobs`: no group waits for the last one's copy to end before it starts)."""
        started = time.perf_counter()
        awake = [g for g in groups if self.engines[g].level == 0]
        if level == 1 and len(awake) > 1 and all(self.engines[g].can_sleep_by_job() for g in awake):
            awake = self._largest_first(awake)
            return self._together(awake, [self.engines[g].sleep_job for g in awake], started)
        return _sum((self._sleep_one(self.engines[g], level) for g in groups), started)

    def _wake_groups(self, groups: list[str], started: float) -> TransferStats:
        """``groups`` resident; those at level 1 copied together (one :func:`run_jobs`)."""
        parked = [g for g in groups if self.engines[g].level == 1]
        if len(parked) > 1 and all(self.engines[g].level in (0, 1) for g in groups):
            parked = self._largest_first(parked)
            return self._together(parked, [self.engines[g].wake_job for g in parked], started)
        return _sum((self.engines[g].wake() for g in groups), started)

    def _largest_first(self, groups: list[str]) -> list[str]:
        """The groups by their copy's size, largest first: its whole copy is queued while the
        smaller groups' jobs are made (the 2026-11-29 H200 logs: a 5-group pipeline slept at
        44-47 GB/s, its largest group made last, against 52 GB/s for one flat buffer)."""
        return sorted(groups, key=lambda g: self.engines[g].flat_bytes, reverse=True)

    @staticmethod
    def _together(
        groups: list[str], makers: list[Callable[[], CopyJob]], started: float
    ) -> TransferStats:
        try:  # the groups share this engine's one device: each job's pieces issued whole
            stats = run_jobs(makers, one_device=True)
        except JobError as error:
            where = f"group {groups[error.index]}" if error.index >= 0 else "the groups' copies"
            raise EngineError(f"{where}: {error.error}") from error.error
        return TransferStats(sum(s.bytes_moved for s in stats), time.perf_counter() - started)

    def asleep(self) -> list[str]:
        """Groups that are not resident now."""
        return [n for n, e in self.engines.items() if e.level != 0]

    def figures(self) -> list[ComponentFigures]:
        """Per group: weights, device bytes now, level."""
        return [
            ComponentFigures(n, e.weights_bytes, e.device_bytes(), e.level)
            for n, e in self.engines.items()
        ]

    @staticmethod
    def _sleep_one(engine: WeightEngine, level: int) -> TransferStats:
        if engine.level == 2 and level == 1:
            return TransferStats(0, 0.0, noop=True)  # deeper already: left there
        return engine.sleep(level)

    # ---- sequential mode -----------------------------------------------------------------

    def _largest(self) -> str:
        return max(self.engines, key=lambda n: self.engines[n].flat_bytes)

    def use(self, group: str) -> None:
        """Make ``group`` the only resident group (the others go to their host copies)."""
        engine = self.engines[group]
        if engine.level == 0:
            return
        for name, other in self.engines.items():
            if name != group and other.level == 0:
                other.sleep(1, reuse_host=True)  # requests only read the weights
        engine.wake()

    def set_sequential(self, on: bool) -> TransferStats:
        """Switch sequential mode while awake: on parks all but the largest group on the host,
        off wakes every group and removes the swap hooks."""
        started = time.perf_counter()
        self.sequential = on
        if on:
            self._install_hooks()
            largest = self._largest()
            stats = [self._sleep_one(e, 1) for n, e in self.engines.items() if n != largest]
            return _sum([*stats, self.engines[largest].wake()], started)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        return _sum((e.wake() for e in self.engines.values()), started)

    def _use_by_name(self, group: str) -> None:
        self.use(group)  # looked up at call time (so a wrapper of ``use`` sees every swap)

    def _install_hooks(self) -> None:
        """Swap a component in before its forward (and the VAE's encode/decode) runs."""
        if self._hooks:
            return
        for name, module in self._modules.items():
            group = self._group_of.get(name)
            if group is None:
                continue
            swap_in = functools.partial(self._use_by_name, group)
            self._hooks.append(module.register_forward_pre_hook(lambda *_, s=swap_in: s()))
            for method in SEQUENTIAL_METHODS:
                bound = getattr(module, method, None)
                if callable(bound):
                    wrapped = _before(bound, swap_in)
                    object.__setattr__(module, method, wrapped)
                    self._hooks.append(_Restore(module, method))


def _before(call: Callable[..., Any], first: Callable[[], None]) -> Callable[..., Any]:
    @functools.wraps(call)
    def run(*args: Any, **kwargs: Any) -> Any:
        first()
        return call(*args, **kwargs)

    return run


class _Restore:
    """Removes an instance-level method wrapper (the hook handles' ``remove``)."""

    def __init__(self, module: torch.nn.Module, method: str) -> None:
        self.module = module
        self.method = method

    def remove(self) -> None:
        self.module.__dict__.pop(self.method, None)
