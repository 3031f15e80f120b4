"""The leader tests' judge of two holders (``tests/e2e/holding_log.py``), on made-up ACKs."""

from __future__ import annotations

from omnistage_operator.decisions.arbiter import WorkerPhase
from omnistage_operator.decisions.facts import AckFacts, WorkerReport
from tests.e2e.holding_log import HoldingLog, Probe, handed_over


def _ack(op: str, task: str, start: float, end: float, *, noop: bool = False) -> AckFacts:
    phase = WorkerPhase.ACTIVE if op == "wake" else WorkerPhase.ASLEEP
    return AckFacts(task, True, op, phase, started_at=start, finished_at=end, noop=noop)


def _report(phase: WorkerPhase, ack: AckFacts | None) -> Probe:
    return Probe(WorkerReport(phase=phase, last_ack=ack), 0, 0.0)


def test_holding_log_finds_two_holders_from_ack_timestamps() -> None:
    """The chaos test's judge: a wake that starts before the other stage's sleep finished is an
    overlap; a wake after it, or a no-op wake, is not."""
    log = HoldingLog()
    log.record("a", _report(WorkerPhase.ACTIVE, None))  # holding from the start
    log.record("b", _report(WorkerPhase.ASLEEP, None))
    log.record("a", _report(WorkerPhase.ASLEEP, _ack("sleep", "1", 10.0, 10.5)))
    log.record("b", _report(WorkerPhase.ACTIVE, _ack("wake", "2", 10.6, 10.8)))
    log.record("b", _report(WorkerPhase.ACTIVE, _ack("wake", "3", 10.9, 10.9, noop=True)))
    assert log.overlaps(["a", "b"]) == []
    assert log.intervals("a", 100.0) == [(float("-inf"), 10.5)]
    log.record("a", _report(WorkerPhase.ACTIVE, _ack("wake", "4", 11.0, 11.2)))  # b still holds
    ((x, y, (lo, hi)),) = log.overlaps(["a", "b"])
    assert (x, y, lo) == ("a", "b", 11.0) and hi > lo


def test_holding_log_allows_only_a_wake_beside_its_own_overlapped_sleep() -> None:
    """In overlapped mode the span from a wake beside a sleep to that sleep's end, in one
    hand-over, is allowed; the same span between other orders (another hand-over's sleep, a
    serial sleep) still is an overlap."""
    log = HoldingLog()
    log.record("a", _report(WorkerPhase.ACTIVE, None))
    log.record("b", _report(WorkerPhase.ASLEEP, None))
    log.record("a", _report(WorkerPhase.ASLEEP, _ack("sleep", "h1-a-sleep1-overlapped", 10, 11)))
    log.record("b", _report(WorkerPhase.ACTIVE, _ack("wake", "h1-b-wake-beside", 10.2, 11.1)))
    assert log.overlaps(["a", "b"], beside=True) == []
    assert len(log.overlaps(["a", "b"])) == 1  # two holders by the ACKs, allowed only beside
    log.record("b", _report(WorkerPhase.ASLEEP, _ack("sleep", "h2-b-sleep1", 20, 21)))
    log.record("a", _report(WorkerPhase.ACTIVE, _ack("wake", "h2-a-wake-beside", 20.5, 21.5)))
    ((x, y, (lo, hi)),) = log.overlaps(["a", "b"], beside=True)  # b's sleep was not overlapped
    assert (x, y, lo, hi) == ("a", "b", 20.5, 21)


def test_a_hand_over_is_a_wake_after_the_sleep_or_beside_its_own_overlapped_sleep() -> None:
    sleep = _ack("sleep", "h1-a-sleep1-overlapped", 10.0, 11.0)
    assert handed_over("a", sleep, "b", _ack("wake", "h1-b-wake-beside", 10.2, 11.1))
    assert handed_over("a", sleep, "b", _ack("wake", "h2-b-wake", 11.5, 12.0))  # after the ACK
    assert not handed_over("a", sleep, "b", _ack("wake", "h2-b-wake-beside", 10.2, 11.1))
    serial = _ack("sleep", "h1-a-sleep1", 10.0, 11.0)
    assert not handed_over("a", serial, "b", _ack("wake", "h1-b-wake-beside", 10.2, 11.1))
