"""Repeated Events aggregated as Kubernetes' own event recorder does (pure; ``Kube.event``
applies the decisions).

- The same Event again (object, type, reason and message) within ``window_s`` updates the one
  recorded: ``count`` + 1 and ``lastTimestamp`` (``kubectl describe``: "x5 over 3m").
- Similar Events (same object, type and reason, other messages): the first ``similar_limit``
  within the window are recorded one by one; after that one Event "(combined from similar
  events): <newest message>" is kept up to date instead. An OnDemand stage that wakes and
  sleeps every minute leaves a few Events with counts, not thousands an hour.

An Event the API no longer has (they expire after an hour) is created again (``forget``).
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["COMBINED_PREFIX", "Decision", "EventSeries", "SeriesKey"]

COMBINED_PREFIX = "(combined from similar events): "
# namespace, object uid (or name), type, reason
SeriesKey = tuple[str, str, str, str]


@dataclass(frozen=True)
class Decision:
    """What to do with an Event: create it, or patch ``name`` to ``count`` with ``message``."""

    message: str
    name: str | None = None  # None: create a new Event
    count: int = 1
    key: tuple[str, ...] = ()  # the series it belongs to (for ``recorded`` and ``forget``)


@dataclass
class _Recorded:
    name: str
    count: int
    first: float


@dataclass
class _Similar:
    times: deque[float] = field(default_factory=deque)


class EventSeries:
    """The Events recorded lately, to decide whether the next one is new or a repeat."""

    def __init__(
        self,
        window_s: float = 600.0,
        similar_limit: int = 10,
        capacity: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.window_s = window_s
        self.similar_limit = similar_limit
        self.capacity = capacity
        self.clock = clock
        self._recorded: OrderedDict[tuple[str, ...], _Recorded] = OrderedDict()
        self._similar: OrderedDict[SeriesKey, _Similar] = OrderedDict()

    def decide(self, key: SeriesKey, message: str) -> Decision:
        """Create or patch (and to what) for an Event of ``key`` saying ``message``."""
        now = self.clock()
        exact = (*key, message)
        seen = self._recorded.get(exact)
        if seen is not None and now - seen.first < self.window_s:
            return Decision(message, seen.name, seen.count + 1, exact)
        similar = self._similar.setdefault(key, _Similar())
        self._similar.move_to_end(key)
        while similar.times and now - similar.times[0] >= self.window_s:
            similar.times.popleft()
        similar.times.append(now)
        if len(similar.times) <= self.similar_limit:
            return Decision(message, key=exact)
        combined = (*key, COMBINED_PREFIX)
        text = COMBINED_PREFIX + message
        seen = self._recorded.get(combined)
        if seen is not None and now - seen.first < self.window_s:
            return Decision(text, seen.name, seen.count + 1, combined)
        return Decision(text, key=combined)

    def recorded(self, decision: Decision, name: str) -> None:
        """The API stored ``decision`` as the Event ``name``."""
        seen = self._recorded.get(decision.key)
        if decision.name is not None and seen is not None:
            seen.count = decision.count
        else:
            self._recorded[decision.key] = _Recorded(name, decision.count, self.clock())
        self._recorded.move_to_end(decision.key)
        for entries in (self._recorded, self._similar):
            while len(entries) > self.capacity:
                entries.popitem(last=False)

    def forget(self, decision: Decision) -> None:
        """The Event to patch is gone: the next one of its series is created."""
        self._recorded.pop(decision.key, None)
