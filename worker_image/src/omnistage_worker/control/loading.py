"""Loading: measure the device context alone, load the model, bring it to its initial state."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from omnistage.worker.v1 import types_pb2
from omnistage_worker.control import prestart
from omnistage_worker.engine import activity
from omnistage_worker.memory import build_probe, feed_accounting

if TYPE_CHECKING:
    from omnistage_worker.control.worker_parts import WorkerParts
    from omnistage_worker.runners.base import SleepController

log = logging.getLogger(__name__)


async def load(worker: WorkerParts) -> None:
    """Load the model and bring it to the initial state; FAILED with the reason on error."""
    try:
        await worker.transition_lane.run(lambda: _load_blocking(worker))
    except Exception as exc:
        log.exception("loading failed")
        await worker.fail(f"loading {worker.config.model} failed: {exc}")
        worker.loaded.set()
        return
    assert worker.controller is not None
    if worker.config.initial_state == "active":
        worker.active_footprint = worker.peak_active = worker.measure().used
        await worker.set_state(types_pb2.WORKER_STATE_ACTIVE, 0)
        prestart.mark("active")
    else:
        worker.measure()
        await worker.set_state(types_pb2.WORKER_STATE_ASLEEP, worker.controller.level)
    worker.loaded.set()


def _load_blocking(worker: WorkerParts) -> None:
    """On the transition lane: the probe and its baseline first, then the weights."""
    config = worker.config
    started = time.monotonic()
    probe = worker.probe = build_probe(config)
    runner = worker.runner
    runner.probe = probe
    if runner.owns_device_context:
        probe.touch()
        baseline_reading = probe.read()
        worker.baseline = baseline_reading.used
        worker.baselines = {d.device: d.used for d in baseline_reading.devices}
        log.info("device context measured: %d bytes (the residual baseline)", worker.baseline)
        prestart.mark("device context measured")
    log.info("loading model from %s", config.model)
    runner.load()
    prestart.mark("model built")
    baseline = runner.residual_baseline()
    if baseline is not None:
        worker.baseline = baseline
        log.info("held asleep, measured by the runner: %d bytes (the residual baseline)", baseline)
    level2_start = config.initial_state == "asleep" and config.sleep_level == 2
    if level2_start and not runner.supports_level2:
        raise RuntimeError("--sleep-level 2 needs *.safetensors weight files to reload from")
    controller = runner.build_controller()
    feed_accounting(probe, per_device_bytes(controller, runner.transient_bytes))
    if config.initial_state == "active":
        stats = controller.activate()
        verb = "activated"
        prestart.mark("weights on device")
        with activity.REQUESTS.busy():  # the host copy's pinning waits for it
            runner.warm_up()  # the first request finds the kernels loaded
        worker.release_cached()
        prestart.mark("warm-up done")
    else:
        stats = controller.start_asleep(config.sleep_level)
        verb = f"started asleep at level {config.sleep_level}"
    worker.controller = controller
    log.info(
        "model %s: %d weight bytes, %d bytes moved in %.2fs (load total %.2fs)",
        verb,
        controller.weights_bytes,
        stats.bytes_moved,
        stats.seconds,
        time.monotonic() - started,
    )


def per_device_bytes(
    controller: SleepController, transient: Callable[[], int] | None = None
) -> list[Callable[[], int]]:
    """How to count the controller's bytes on each of its devices (one: all of them, plus
    the ``transient`` bytes the runner holds for requests, such as a batch's KV cache)."""
    from omnistage_worker.engine.sharded import ShardedEngine

    if isinstance(controller, ShardedEngine):
        return [shard.device_bytes for shard in controller.shards]
    if transient is None:
        return [controller.device_bytes]
    weights = controller.device_bytes
    return [lambda: weights() + transient()]
