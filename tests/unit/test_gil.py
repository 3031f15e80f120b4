"""The lowered switch interval of a transition: held by several at once, restored by the last."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import pytest

from omnistage_worker.engine import gil
from omnistage_worker.engine.gil import quick_switching

BEFORE = 0.0042


@pytest.fixture(autouse=True)
def odd_interval() -> Iterator[None]:
    saved = sys.getswitchinterval()
    sys.setswitchinterval(BEFORE)
    try:
        yield
    finally:
        sys.setswitchinterval(saved)


def interval() -> float:
    return sys.getswitchinterval()


def test_lowered_inside_and_restored_after_even_on_an_error() -> None:
    with quick_switching():
        assert interval() == pytest.approx(gil.SWITCH_INTERVAL_S)
    assert interval() == pytest.approx(BEFORE)
    with pytest.raises(RuntimeError, match="copy failed"), quick_switching(1e-5):
        assert interval() == pytest.approx(1e-5)
        raise RuntimeError("copy failed")
    assert interval() == pytest.approx(BEFORE)


def test_overlapping_holders_on_two_threads_restore_only_when_the_last_leaves() -> None:
    """A enters, B enters, A leaves (B still issues: still low), B leaves: restored to what
    it was before A, not to the lowered value B found."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen: dict[str, float] = {}

    def a() -> None:
        with quick_switching():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b() -> None:
        a_in.wait(10)
        with quick_switching():
            b_in.set()
            a_out.wait(10)
            seen["b after a left"] = interval()
        seen["after both"] = interval()

    threads = [threading.Thread(target=f) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert seen["b after a left"] == pytest.approx(gil.SWITCH_INTERVAL_S)
    assert seen["after both"] == pytest.approx(BEFORE)


def test_a_holder_never_raises_the_interval_another_lowered_further() -> None:
    with quick_switching(1e-5):
        with quick_switching(1e-3):
            assert interval() == pytest.approx(1e-5)
        assert interval() == pytest.approx(1e-5)
    assert interval() == pytest.approx(BEFORE)


def test_none_leaves_the_interval_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gil, "SWITCH_INTERVAL_S", None)
    with quick_switching():
        assert interval() == pytest.approx(BEFORE)
    assert interval() == pytest.approx(BEFORE)
