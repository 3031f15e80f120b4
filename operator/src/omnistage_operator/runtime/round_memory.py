"""What a hand-over round taught beyond the round (``RoundMemory``, mixed into
``runner.GroupRunner``): learned needs, the workers' own words on a sleep or wake that did not go
through (until one does), refused deepenings and component sleeps, and the back-off after a wake
that ran out of device memory or that its worker failed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from omnistage_operator.api import conditions as cond
from omnistage_operator.decisions.handover import RoundOutcome
from omnistage_operator.decisions.wake_backoff import REASON as WAKE_OOM
from omnistage_operator.decisions.wake_backoff import WakeBackoff, failure_message, oom_message
from omnistage_operator.k8s.port import KubeGroupPort

__all__ = ["RoundMemory"]

log = logging.getLogger(__name__)

StageKey = tuple[str, str]  # (namespace, stage)


class RoundMemory:
    """Memory half of ``GroupRunner`` (the attributes below are the runner's)."""

    learned: dict[StageKey, int]
    wake_backoffs: dict[StageKey, WakeBackoff]
    sleep_problems: dict[StageKey, tuple[str, str]]
    wake_problems: dict[StageKey, tuple[str, str]]
    component_problems: dict[StageKey, tuple[str, str]]
    component_refused: dict[StageKey, tuple[str, ...]]
    deepen_refused: dict[StageKey, int]
    stage_problems: dict[StageKey, tuple[str, str]]
    emit: Callable[..., None]

    def _remember(self, namespace: str, outcome: RoundOutcome) -> None:
        """Keep what a round learned beyond the round: needs, and the workers' own words on a
        sleep or wake that did not go through (until one does)."""
        for name, need in outcome.learned_needs.items():
            self.learned[(namespace, name)] = need
        for s in outcome.sleeps:
            key = (namespace, s.order.stage)
            problems = self.component_problems if s.order.components else self.sleep_problems
            if s.ok:
                problems.pop(key, None)
            else:
                problems[key] = (s.reason.value, s.message)
            if s.order.components and s.refusal is not None and not s.refusal.worker_failed:
                self.component_refused[key] = s.order.components
            deepening = not s.order.releases_memory and not s.order.components
            if deepening and s.refusal is not None and not s.refusal.worker_failed:
                self.deepen_refused[key] = s.order.level
        for name in outcome.wakes:
            if name not in outcome.wake_errors:
                self.wake_problems.pop((namespace, name), None)
                if name in outcome.component_wakes:
                    self.component_problems.pop((namespace, name), None)
        for name in outcome.started:
            self.stage_problems.pop((namespace, name), None)
        for name, err in outcome.stage_errors.items():
            self.stage_problems[(namespace, name)] = (cond.Reason.STAGE_ERROR.value, err)
        for name, err in outcome.wake_errors.items():
            refused = name in outcome.wake_refusals
            reason = cond.Reason.WAKE_REFUSED if refused else cond.Reason.ACK_FAILED
            into = (
                self.component_problems if name in outcome.component_wakes else self.wake_problems
            )
            into[(namespace, name)] = (reason.value, err)

    def _note_wake_oom(self, port: KubeGroupPort, outcome: RoundOutcome) -> None:
        """Wakes that ran out of device memory: back off (doubling), say so with the figures
        (the stage's Ready condition and an Event); a wake that went through ends it. A wake
        whose worker failed it otherwise (back asleep, ACK not ok: a vLLM engine that cannot
        start) backs off the same way (its Event is the round's ``WakeFailed``)."""
        now = time.time()
        for name, ack in outcome.wakes.items():
            if ack.ok:
                self.wake_backoffs.pop((port.ns, name), None)
        for name, ack in outcome.wake_oom.items():
            key = (port.ns, name)
            backoff = self.wake_backoffs.get(key, WakeBackoff()).after_oom(now, ack.needed_bytes)
            self.wake_backoffs[key] = backoff
            message = oom_message(ack, self.learned.get(key, 0), backoff, now)
            self.wake_problems[key] = (WAKE_OOM, message)
            log.warning("%s/%s: %s", port.ns, name, message)
            if name in port.bodies:
                self.emit(port.bodies[name], WAKE_OOM, message, warning=True)
        for name, ack in outcome.wakes.items():
            if ack.ok or name in outcome.wake_oom or name in outcome.component_wakes:
                continue
            key = (port.ns, name)
            backoff = self.wake_backoffs.get(key, WakeBackoff()).after_failure(now)
            self.wake_backoffs[key] = backoff
            message = failure_message(ack, backoff, now)
            self.wake_problems[key] = (cond.Reason.ACK_FAILED.value, message)
            log.warning("%s/%s: %s", port.ns, name, message)
