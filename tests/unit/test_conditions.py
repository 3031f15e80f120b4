"""metav1.Condition list helpers."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnistage_operator.api.conditions import (
    ADMITTED,
    ASLEEP,
    CONDITION_TYPES,
    MEMORY_RELEASED,
    READY,
    ConditionStatus,
    Reason,
    format_time,
    get_condition,
    is_true,
    set_condition,
)

T0 = datetime(2026, 11, 21, 5, 0, 0, 123456, tzinfo=UTC)
T1 = T0 + timedelta(seconds=30)


def test_types() -> None:
    assert CONDITION_TYPES == ("Ready", "Asleep", "MemoryReleased", "Admitted")
    assert (READY, ASLEEP, MEMORY_RELEASED, ADMITTED) == CONDITION_TYPES


def test_add_new_condition() -> None:
    conds = set_condition([], READY, True, Reason.WORKER_READY, "worker serving", 3, T0)
    assert conds == [
        {
            "type": "Ready",
            "status": "True",
            "reason": "WorkerReady",
            "message": "worker serving",
            "lastTransitionTime": "2026-11-21T05:00:00Z",
            "observedGeneration": 3,
        }
    ]


def test_same_status_keeps_transition_time_but_updates_the_rest() -> None:
    conds = set_condition(None, ASLEEP, "True", Reason.SLEEP_ACKNOWLEDGED, "level 1", 1, T0)
    conds = set_condition(conds, ASLEEP, ConditionStatus.TRUE, "SleepAcknowledged", "lvl 2", 2, T1)
    (c,) = conds
    assert c["lastTransitionTime"] == "2026-11-21T05:00:00Z"
    assert c["message"] == "lvl 2" and c["observedGeneration"] == 2


def test_status_change_moves_transition_time() -> None:
    conds = set_condition([], ASLEEP, True, Reason.SLEEP_ACKNOWLEDGED, "", 1, T0)
    conds = set_condition(conds, ASLEEP, False, Reason.WAKE_ACKNOWLEDGED, "awake", 1, T1)
    assert conds[0]["lastTransitionTime"] == "2026-11-21T05:00:30Z"
    assert conds[0]["status"] == "False" and conds[0]["reason"] == "WakeAcknowledged"


def test_other_conditions_untouched_and_order_kept() -> None:
    conds = set_condition([], READY, True, Reason.WORKER_READY, "", 1, T0)
    conds = set_condition(conds, ADMITTED, False, Reason.WAITING_FOR_MEMORY, "waits for b", 1, T0)
    before = [dict(c) for c in conds]
    updated = set_condition(conds, READY, False, Reason.WORKER_LOST, "pod gone", 1, T1)
    assert conds == before  # input not mutated
    assert [c["type"] for c in updated] == ["Ready", "Admitted"]
    assert updated[1] == before[1]


def test_duplicates_collapse() -> None:
    dup = [
        {
            "type": "Ready",
            "status": "True",
            "reason": "A",
            "message": "",
            "lastTransitionTime": "x",
        },
        {
            "type": "Ready",
            "status": "False",
            "reason": "B",
            "message": "",
            "lastTransitionTime": "y",
        },
    ]
    out = set_condition(dup, READY, True, "A", "", 0, T1)
    assert len(out) == 1 and out[0]["lastTransitionTime"] == "x"


def test_get_and_is_true() -> None:
    conds = set_condition([], MEMORY_RELEASED, True, Reason.MEMORY_VERIFIED, "freed 3.2Gi", 1, T0)
    got = get_condition(conds, MEMORY_RELEASED)
    assert got is not None and got["reason"] == "MemoryVerified"
    got["status"] = "False"
    assert is_true(conds, MEMORY_RELEASED)  # get_condition returned a copy
    assert get_condition(conds, READY) is None
    assert not is_true(conds, READY)
    assert not is_true(None, READY)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"status": "Yes"}, "status"),
        ({"reason": "not camel"}, "reason"),
        ({"reason": ""}, "reason"),
        ({"type_": "bad type"}, "type"),
        ({"observed_generation": -1}, "observedGeneration"),
        ({"now": datetime(2026, 1, 1)}, "timezone"),
    ],
)
def test_rejects_malformed(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "conditions": [],
        "type_": READY,
        "status": True,
        "reason": "WorkerReady",
        "message": "",
        "observed_generation": 0,
        "now": T0,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        set_condition(**args)  # type: ignore[arg-type]


def test_long_message_is_cut() -> None:
    (c,) = set_condition([], READY, False, Reason.FAILED, "x" * 40000, 0, T0)
    assert len(c["message"]) == 32768 and c["message"].endswith("...")


def test_format_time_converts_to_utc() -> None:
    plus2 = timezone(timedelta(hours=2))
    assert format_time(datetime(2026, 11, 21, 7, 0, 5, tzinfo=plus2)) == "2026-11-21T05:00:05Z"


def test_all_reasons_are_camel_case() -> None:
    for reason in Reason:
        set_condition([], READY, True, reason, "", 0, T0)
        assert reason.value[0].isupper()


@given(
    st.lists(
        st.tuples(
            st.sampled_from(CONDITION_TYPES),
            st.sampled_from(list(ConditionStatus)),
            st.integers(min_value=0, max_value=3600),
        ),
        max_size=30,
    )
)
def test_transition_time_is_the_time_of_the_last_status_change(
    steps: list[tuple[str, ConditionStatus, int]],
) -> None:
    conds: list[dict[str, Any]] = []
    expected: dict[str, tuple[str, str]] = {}  # type -> (status, time of last change)
    elapsed = 0
    for type_, status, delta in steps:
        elapsed += delta
        now = T0 + timedelta(seconds=elapsed)
        conds = set_condition(conds, type_, status, "Step", "", 0, now)
        prior = expected.get(type_)
        if prior is None or prior[0] != status.value:
            expected[type_] = (status.value, format_time(now))
    assert len(conds) == len(expected)
    for c in conds:
        assert (c["status"], c["lastTransitionTime"]) == expected[str(c["type"])]
