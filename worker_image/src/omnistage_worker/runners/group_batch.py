"""Batching of whole calls: requests that wait with the same key run as one call.

A diffusion pipeline makes a batch of images of one size and one set of parameters in one
call; requests of another size wait for their own call. The oldest waiting request decides
the next call; every request waiting with its key (up to the batch) joins it, in arrival order.
Requests that arrive while a call runs wait for the next one.
"""

from __future__ import annotations

import concurrent.futures
import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from omnistage_worker.runners.serving_thread import ServingThread

log = logging.getLogger(__name__)

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Waiting(Generic[Item, Result]):
    item: Item
    key: Hashable
    future: concurrent.futures.Future[Result] = field(default_factory=concurrent.futures.Future)


class GroupBatcher(ServingThread, Generic[Item, Result]):
    """Runs ``run(items)`` (one result per item, in order) on a daemon thread of its own."""

    def __init__(
        self,
        run: Callable[[list[Item]], Sequence[Result]],
        key: Callable[[Item], Hashable],
        max_batch: int,
        name: str = "omnistage-group-batch",
    ) -> None:
        self._run = run
        self._key = key
        self.max_batch = max(1, max_batch)
        super().__init__(name)
        self._waiting: list[_Waiting[Item, Result]] = []
        self.calls = 0

    def submit(self, item: Item) -> concurrent.futures.Future[Result]:
        """Queue ``item`` (its key is computed now); it runs with others of the same key."""
        waiting: _Waiting[Item, Result] = _Waiting(item, self._key(item))
        self._enqueue(lambda: self._waiting.append(waiting))
        return waiting.future

    def _next_batch(self) -> list[_Waiting[Item, Result]] | None:
        with self._cond:
            while not self._waiting:
                if self._closed:
                    return None
                self._cond.wait()
            key = self._waiting[0].key
            batch = [w for w in self._waiting if w.key == key][: self.max_batch]
            chosen = {id(w) for w in batch}
            self._waiting = [w for w in self._waiting if id(w) not in chosen]
            return batch

    def _serve(self) -> None:
        while (batch := self._next_batch()) is not None:
            self.calls += 1
            try:
                results = list(self._run([w.item for w in batch]))
                if len(results) != len(batch):
                    raise RuntimeError(f"{len(results)} results for {len(batch)} requests")
            except Exception as exc:
                log.exception("a batched call of %d request(s) failed", len(batch))
                for waiting in batch:
                    waiting.future.set_exception(exc)
                continue
            for waiting, result in zip(batch, results, strict=True):
                waiting.future.set_result(result)
