"""A harness part used as a context manager: started on enter (stopped again if the start
fails), stopped on exit, with its start time in ``timings["start"]``."""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from types import TracebackType
from typing import Self


class Lifecycle(ABC):
    """``with part:`` runs :meth:`_start` and, whatever happens, :meth:`stop`."""

    timings: dict[str, float]

    def __enter__(self) -> Self:
        start = time.monotonic()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        self.timings["start"] = time.monotonic() - start
        print(self._started(self.timings["start"]), flush=True)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    @abstractmethod
    def _start(self) -> None:
        """Bring the part up."""

    @abstractmethod
    def stop(self) -> None:
        """Take the part down completely (also after a failed start)."""

    @abstractmethod
    def _started(self, seconds: float) -> str:
        """The log line that says the part is up."""
