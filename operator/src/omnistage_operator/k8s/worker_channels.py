"""The operator's open gRPC channels to workers: one per stage, to its current pod.

A channel (grpc C-core: its subchannel, socket and buffers, outside Python's heap) lives until
closed. Kept by address alone, the channel to every pod ever replaced would stay open for the
rest of the process; kept per stage, the channel to a stage's previous pod is closed as soon as
a round asks for its new pod (another pod uid or address), and a deleted stage's when the
stage is forgotten. Channels open never outnumber the stages.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

__all__ = ["WorkerChannels"]

log = logging.getLogger(__name__)

StageKey = tuple[str, str]  # (namespace, stage)


class Channel(Protocol):
    """What is kept: a worker client (``worker_client.WorkerClient``)."""

    async def close(self) -> None: ...


C = TypeVar("C", bound=Channel)


@dataclass(frozen=True)
class _Held(Generic[C]):
    uid: str  # the pod's
    target: str  # address, with "+tls" for a TLS channel
    client: C


class WorkerChannels(Generic[C]):
    """Channels by stage; a stage's channel follows its pod."""

    def __init__(self) -> None:
        self._held: dict[StageKey, _Held[C]] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        """Channels open or still closing."""
        return len(self._held) + len(self._closing)

    def get(self, stage: StageKey, uid: str, target: str, make: Callable[[], C]) -> C:
        """The channel to pod ``uid`` of ``stage`` at ``target`` (``make`` builds a new one);
        a channel to the stage's previous pod is closed."""
        held = self._held.get(stage)
        if held is not None and held.uid == uid and held.target == target:
            return held.client
        if held is not None:
            log.debug("%s/%s: pod %s replaced by %s: channel closed", *stage, held.uid, uid)
            self._close(held.client)
        client = make()
        self._held[stage] = _Held(uid, target, client)
        return client

    def drop(self, stage: StageKey) -> None:
        """Close the stage's channel (the stage was deleted)."""
        held = self._held.pop(stage, None)
        if held is not None:
            self._close(held.client)

    def _close(self, client: C) -> None:
        task = asyncio.get_running_loop().create_task(client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every channel (the operator stops)."""
        for stage in list(self._held):
            self.drop(stage)
        await asyncio.gather(*self._closing, return_exceptions=True)
