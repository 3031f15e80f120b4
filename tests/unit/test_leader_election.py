"""The election's pure decisions: who may acquire, who still leads, which epoch."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from omnistage_operator.decisions.election import (
    Action,
    LeaseRecord,
    Observation,
    Tenure,
    Timing,
    TimingError,
    decide,
    leading,
    observe,
    parse_record,
    release_patch,
    write_for,
)

T = Timing(lease_duration_s=15, renew_deadline_s=10, retry_period_s=2)
NOW = datetime(2026, 11, 22, 21, 0, 0, tzinfo=UTC)


def _obs(
    holder: str, at: float, rv: str = "7", duration: int = 15, transitions: int = 3
) -> Observation:
    return Observation(LeaseRecord(rv, holder, duration, transitions), at)


def test_timing_must_let_the_holder_stop_before_the_lease_expires() -> None:
    with pytest.raises(TimingError, match="lease duration"):
        Timing(10, 10, 2)
    with pytest.raises(TimingError, match="renew deadline"):
        Timing(15, 2, 2)
    with pytest.raises(TimingError, match="retry period"):
        Timing(15, 10, 0)
    assert Timing(3, 2, 0.5).lease_seconds == 3
    assert Timing(2.5, 2, 0.5).lease_seconds == 3  # rounded up: never shorter than asked


def test_parse_record_reads_the_api_shape() -> None:
    raw = {
        "metadata": {"name": "l", "resourceVersion": "42"},
        "spec": {"holderIdentity": "op-0_ab", "leaseDurationSeconds": 15, "leaseTransitions": 4},
    }
    assert parse_record(raw) == LeaseRecord("42", "op-0_ab", 15, 4)
    assert parse_record({"metadata": {"resourceVersion": "1"}, "spec": {}}) == LeaseRecord("1")


def test_observation_clock_restarts_only_when_the_record_changes() -> None:
    rec = LeaseRecord("5", "a", 15, 1)
    first = observe(None, rec, 100.0)
    assert first == Observation(rec, 100.0)
    assert observe(first, LeaseRecord("5", "a", 15, 1), 110.0) is first  # same version
    renewed = observe(first, LeaseRecord("6", "a", 15, 1), 111.0)
    assert renewed == Observation(LeaseRecord("6", "a", 15, 1), 111.0)
    assert observe(first, None, 120.0) is None


def test_no_lease_is_created() -> None:
    assert decide("me", None, 0.0, T) is Action.CREATE


def test_own_lease_is_renewed() -> None:
    assert decide("me", _obs("me", 0.0), 1000.0, T) is Action.RENEW


def test_held_lease_is_waited_for_until_expired_by_our_own_clock() -> None:
    obs = _obs("other", 100.0)
    assert decide("me", obs, 100.0, T) is Action.WAIT
    assert decide("me", obs, 114.99, T) is Action.WAIT
    assert decide("me", obs, 115.0, T) is Action.TAKE_OVER


def test_holder_duration_counts_not_ours() -> None:
    # The holder wrote 30 s; our shorter setting does not shorten its lease.
    assert decide("me", _obs("other", 0.0, duration=30), 20.0, T) is Action.WAIT
    assert decide("me", _obs("other", 0.0, duration=30), 30.0, T) is Action.TAKE_OVER
    # A record without a duration gets ours.
    assert decide("me", _obs("other", 0.0, duration=0), 15.0, T) is Action.TAKE_OVER


def test_released_lease_is_taken_at_once() -> None:
    assert decide("me", _obs("", 100.0), 100.0, T) is Action.TAKE_OVER


def test_writes_and_epochs() -> None:
    spec, epoch = write_for(Action.CREATE, "me", None, NOW, T)
    assert epoch == 1  # never 0: 0 is "no election"
    assert spec == {
        "holderIdentity": "me",
        "leaseDurationSeconds": 15,
        "acquireTime": "2026-11-22T21:00:00.000000Z",
        "renewTime": "2026-11-22T21:00:00.000000Z",
        "leaseTransitions": 1,
    }
    rec = LeaseRecord("9", "other", 15, 4)
    spec, epoch = write_for(Action.TAKE_OVER, "me", rec, NOW, T)
    assert epoch == 5 and spec["leaseTransitions"] == 5 and spec["holderIdentity"] == "me"
    assert "acquireTime" in spec
    mine = LeaseRecord("10", "me", 15, 5)
    spec, epoch = write_for(Action.RENEW, "me", mine, NOW, T)
    assert epoch == 5
    assert "leaseTransitions" not in spec and "acquireTime" not in spec
    with pytest.raises(ValueError):
        write_for(Action.WAIT, "me", rec, NOW, T)
    with pytest.raises(ValueError):
        write_for(Action.RENEW, "me", None, NOW, T)


def test_a_recreated_or_taken_over_lease_continues_above_the_last_epoch() -> None:
    """The last granted epoch kept outside the Lease (``floor``) is never gone back below."""
    spec, epoch = write_for(Action.CREATE, "me", None, NOW, T, floor=7)
    assert epoch == 8 and spec["leaseTransitions"] == 8
    rec = LeaseRecord("9", "other", 15, 2)  # a Lease re-created by hand, then held once
    spec, epoch = write_for(Action.TAKE_OVER, "me", rec, NOW, T, floor=7)
    assert epoch == 8 and spec["leaseTransitions"] == 8
    spec, epoch = write_for(Action.TAKE_OVER, "me", LeaseRecord("9", "o", 15, 9), NOW, T, floor=7)
    assert epoch == 10


def test_release_clears_the_holder() -> None:
    patch = release_patch(NOW)
    assert patch["holderIdentity"] is None and patch["leaseDurationSeconds"] == 1


def test_leading_ends_at_the_renew_deadline() -> None:
    assert not leading(None, 0.0, T)
    tenure = Tenure(epoch=3, renewed_at=50.0)
    assert leading(tenure, 50.0, T)
    assert leading(tenure, 59.99, T)
    assert not leading(tenure, 60.0, T)


@pytest.mark.parametrize("gap", [0.0, 0.3, 2.0, 9.9])
def test_holder_stops_leading_before_any_candidate_may_take_over(gap: float) -> None:
    """The safety margin: a renew sent at t is seen by a candidate no earlier than t (+gap);
    the holder's leadership ends at t + renew deadline, the candidate's wait at least
    lease duration later than its sighting."""
    sent = 100.0
    tenure = Tenure(2, sent)
    obs = _obs("holder", sent + gap, transitions=2)
    first_take_over = next(
        t / 100 for t in range(int(sent * 100), int(sent * 100) + 5000)
        if decide("cand", obs, t / 100, T) is Action.TAKE_OVER
    )  # fmt: skip
    last_leading = max(
        t / 100
        for t in range(int(sent * 100), int(sent * 100) + 5000)
        if leading(tenure, t / 100, T)
    )
    assert first_take_over - last_leading >= T.lease_duration_s - T.renew_deadline_s - 0.011
