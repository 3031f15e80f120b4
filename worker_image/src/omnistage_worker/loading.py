"""Loading: measure the device context alone, load the model, bring it to its initial state."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from omnistage.worker.v1 import types_pb2
from omnistage_worker.memory import AccountingProbe, build_probe

if TYPE_CHECKING:
    from omnistage_worker.state import Worker

log = logging.getLogger(__name__)


async def load(worker: Worker) -> None:
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
    else:
        worker.measure()
        await worker.set_state(types_pb2.WORKER_STATE_ASLEEP, worker.controller.level)
    worker.loaded.set()


def _load_blocking(worker: Worker) -> None:
    """On the transition lane: the probe and its baseline first, then the weights."""
    config = worker.config
    started = time.monotonic()
    probe = worker.probe = build_probe(config)
    runner = worker.runner
    runner.probe = probe
    if runner.owns_device_context:
        probe.touch()
        worker.baseline = probe.read().used
        log.info("device context measured: %d bytes (the residual baseline)", worker.baseline)
    log.info("loading model from %s", config.model)
    runner.load()
    baseline = runner.residual_baseline()
    if baseline is not None:
        worker.baseline = baseline
        log.info("held asleep, measured by the runner: %d bytes (the residual baseline)", baseline)
    level2_start = config.initial_state == "asleep" and config.sleep_level == 2
    if level2_start and not runner.supports_level2:
        raise RuntimeError("--sleep-level 2 needs *.safetensors weight files to reload from")
    controller = runner.build_controller()
    if isinstance(probe, AccountingProbe):
        probe.set_used_fn(controller.device_bytes)
    if config.initial_state == "active":
        stats = controller.activate()
        verb = "activated"
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
