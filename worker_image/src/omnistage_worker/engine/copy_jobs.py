"""Level-1 transitions of one or several devices, issued from one thread.

A level-1 sleep or wake is one device's copy of its flat buffer, in pieces (``pinning.pieces``)
followed by work that waits for them. Each device's part is a :class:`CopyJob`. :func:`run_jobs`
makes the jobs in turn (a wake allocates its device buffer then), issues the first
:data:`LEAD_PIECES` of each as soon as it is made, so a device copies while the next one
allocates, then issues the rest of every device's pieces interleaved (device 0 piece i,
device 1 piece i, ...) in one call, each on its own device's current stream, so the devices
copy at once; then finishes the jobs in device order. Jobs of one device (a pipeline's groups)
have nothing to interleave with: each job's pieces are issued whole as it is made. Everything
runs with the switch interval lowered (:mod:`.gil`).

Why one thread, measured on 2 x H200 (``bench/results/multi_gpu_probe.json``): a bare copy
into a kept buffer issued for both devices from one thread ran at 0.999 of the per-device limit
(both copying at once), while the engine's wake on one thread per device ran at 0.90 of the same
wake done one device at a time, and at 0.025 beside a busy Python thread.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from omnistage_worker.engine.gil import quick_switching
from omnistage_worker.engine.pinning import Step, copy_pieces, follow_marks

LEAD_PIECES = 8
"""Pieces a device is given before the next device's job is made: 512 MiB, about 10 ms of
copying at 54 GB/s, which covers the next wake's allocation (4-9 ms for 8 GiB on the H200)."""


@dataclass(frozen=True)
class JobStats:
    """What one device's part of a transition moved and when it ended."""

    bytes_moved: int
    ended: float  # time.perf_counter()


@dataclass
class CopyJob:
    """One device's part of a level-1 transition: its pieces, then what completes it."""

    pieces: Sequence[Step]
    """Its copies, and the marks a sleep releases its device memory behind."""
    finish: Callable[[], int]
    """Waits for the pieces and completes the transition; the bytes it moved."""
    abort: Callable[[], None]
    """The transition did not happen: waits for what was issued and gives back what is held
    (called once nothing references the job, so a wake's new device buffer is gone by then)."""


def interleave(queues: Sequence[Sequence[Step]]) -> list[Step]:
    """Piece 0 of every queue, then piece 1 of every queue, ...; a short queue drops out."""
    return [
        piece for round_ in itertools.zip_longest(*queues) for piece in round_ if piece is not None
    ]


class JobError(RuntimeError):
    """Job ``index`` failed (made, issued or finished); the cause is chained."""

    def __init__(self, index: int, error: BaseException) -> None:
        super().__init__(f"job {index}: {error}")
        self.index = index
        self.error = error


def run_jobs(
    makers: Sequence[Callable[[], CopyJob]], *, one_device: bool = False
) -> list[JobStats]:
    """Make, issue and finish the jobs from this thread (see the module's docstring).

    ``one_device``: the jobs share one device (a pipeline's groups), so there is nothing to
    interleave with; each job's pieces are issued whole as soon as it is made, and the copy
    engine has the first job's whole copy queued while Python makes the next ones (put the
    largest first).

    A failure before every job is issued aborts every job made (nothing has moved); a failure
    in a finish is raised once the other jobs are finished (theirs have moved)."""
    with quick_switching():
        jobs: list[CopyJob] = []
        issued: list[Step] = []  # in issue order: the marks are followed in it
        where = 0  # the job being made or given its lead; -1: the interleaved issue
        try:
            for make in makers:
                where = len(jobs)
                jobs.append(make())
                head = jobs[-1].pieces[: None if one_device else LEAD_PIECES]
                copy_pieces(head)
                issued += head
            where = -1
            rest = [] if one_device else interleave([j.pieces[LEAD_PIECES:] for j in jobs])
            copy_pieces(rest)
            issued += rest
        except BaseException as error:
            aborts = [job.abort for job in jobs]
            jobs.clear()  # their device buffers go before the aborts give memory back
            for abort in aborts:
                with contextlib.suppress(Exception):
                    abort()
            if not isinstance(error, Exception):
                raise  # an interrupt stays one
            raise JobError(where, error) from error
        failed: JobError | None = None
        try:  # a sleep's memory goes back behind its copy, before any job's finish waits
            follow_marks(issued)
        except Exception as error:
            failed = JobError(-1, error)
        stats: list[JobStats] = []
        for index, job in enumerate(jobs):
            try:
                stats.append(JobStats(job.finish(), time.perf_counter()))
            except Exception as error:
                failed = failed or JobError(index, error)
                stats.append(JobStats(0, time.perf_counter()))
        if failed is not None:
            raise failed from failed.error
        return stats
