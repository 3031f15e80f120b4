"""The caller's side of one hand-over between two workers, serial or overlapped, as
``bench/overlap.py`` drives it (the operator's rounds do the serial one; the overlapped one is
issue 23's moonshot, not in the operator yet).

Overlapped: the outgoing worker's ``SleepStream`` and the incoming worker's ``WakeUp`` with
``claim_limit_bytes`` go out at once. The first limit is what the incoming worker holds plus
the device's free memory less a margin; each ``MemoryReleased`` the stream reports (measured by
the outgoing worker, NVML for its process) raises it by that much, and the sleep's Ack by its
measured ``freed_bytes``. So the incoming worker never holds memory the outgoing one has not
reported given back.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from bench.gpu_e2e_analysis import Sample, device_shares, stage_bytes, uncharged
from bench.worker_grpc import Worker, ack_json, call_sleep, call_wake
from omnistage.worker.v1 import sleep_service_pb2, types_pb2

Json = dict[str, Any]
LEVEL1 = types_pb2.SleepLevel.ValueType(1)


def serial(out: Worker, inc: Worker) -> Json:
    """Sleep ``out``, then wake ``inc``: the operator's hand-over, timed by its caller."""
    t0 = time.perf_counter()
    slept = call_sleep(out, 1)
    woke = call_wake(inc)
    return {"mode": "serial", "seconds": time.perf_counter() - t0, "sleep": slept, "wake": woke}


def overlapped(out: Worker, inc: Worker, margin: int, *, handoff: bool = False) -> Json:
    """Sleep ``out`` and wake ``inc`` at once, the wake's limit raised by each measured release
    (see the module's docstring); with ``handoff``, over a hand-off channel named after the
    wake (both workers need a hand-off directory, the same one)."""
    status = inc.sleep.GetStatus(sleep_service_pb2.GetStatusRequest(), timeout=30)
    base = status.used_bytes + max(0, status.free_bytes - margin)
    wake_id = str(uuid.uuid4())
    channel = wake_id if handoff else ""
    t0 = time.perf_counter()
    wake = inc.sleep.WakeUp.future(
        sleep_service_pb2.WakeUpRequest(
            task_id=wake_id, claim_limit_bytes=base, handoff_channel=channel
        ),
        timeout=300,
    )
    request = sleep_service_pb2.SleepStreamRequest(
        sleep=sleep_service_pb2.SleepRequest(task_id=str(uuid.uuid4()), level=LEVEL1),
        handoff_channel=channel,
    )
    raises: list[tuple[float, int]] = []
    released = 0
    sleep_ack: types_pb2.Ack | None = None
    for message in out.sleep.SleepStream(request, timeout=300):
        if message.WhichOneof("event") == "released":
            if message.released.released_bytes <= released:
                continue  # the first message (nothing released yet): the room is in base
            released = message.released.released_bytes
        else:
            sleep_ack = message.ack
            released = max(released, sleep_ack.freed_bytes if sleep_ack.ok else 0)
        inc.sleep.RaiseClaimLimit(
            sleep_service_pb2.RaiseClaimLimitRequest(
                task_id=wake_id, claim_limit_bytes=base + released
            ),
            timeout=30,
        )
        raises.append((time.perf_counter() - t0, released))
    t1 = time.perf_counter()
    woke = wake.result()
    t2 = time.perf_counter()
    assert sleep_ack is not None
    return {
        "mode": "overlapped",
        "handoff": handoff,
        "seconds": t2 - t0,
        "first_limit_bytes": base,
        "limit_raises": len(raises),
        "first_raise_s": raises[0][0] if raises else None,
        "sleep": ack_json(sleep_ack, t1 - t0),
        "wake": ack_json(woke.ack, t2 - t0),
    }


def room_check(samples: Sequence[Sample], pids: Iterable[int], room: int) -> Json:
    """The most the two stages (``pids``) held together in any sample of
    ``gpu_e2e_children.child_sampler``, against the room they share; and the same with the
    device's memory charged to no process counted as theirs beyond what it was in the first
    sample (a piece handed over is charged to no one between the two processes' handles; one
    freed may stay used while the driver cleans it), the ``device_`` figures."""
    pids = list(pids)
    together = [stage_bytes(s, pids) for s in samples]
    over = [t for t in together if t > room]
    unowned = uncharged(samples)
    device = device_shares(samples, pids)
    return {
        "samples": len(samples),
        "room_bytes": room,
        "peak_together_bytes": max(together, default=0),
        "samples_over_room": len(over),
        "within_room": not over,
        "device_peak_bytes": max(device, default=0),
        "device_samples_over_room": sum(d > room for d in device),
        "device_uncharged_first_bytes": unowned[0] if unowned else 0,
        "device_uncharged_peak_bytes": max(unowned, default=0),
    }
