"""Event aggregation (omnistage_operator.decisions.event_series) through ``Kube.event`` against the
real API server: repeats update one Event's count, similar ones are combined past the limit, an
Event the API lost is recorded anew, and a new window starts a new Event."""

from __future__ import annotations

from typing import Any

import kr8s.asyncio
import pytest

from omnistage_operator.decisions.event_series import COMBINED_PREFIX, EventSeries
from omnistage_operator.k8s.kube import Kube
from tests.cluster.controlplane import ControlPlane

pytestmark = [pytest.mark.timeout(120)]


def events(cp: ControlPlane, namespace: str, reason: str) -> list[dict[str, Any]]:
    data = cp.get_json(
        "events", "--field-selector", f"involvedObject.name=subject,reason={reason}",
        namespace=namespace,
    )  # fmt: skip
    return sorted(data["items"], key=lambda e: e["eventTime"])  # microseconds; creation: s


async def test_repeats_and_similar_events_are_aggregated(
    control_plane: ControlPlane, namespace: str
) -> None:
    cp = control_plane
    cp.kubectl("create", "configmap", "subject", "-n", namespace)
    subject = cp.get_json("configmap", "subject", namespace=namespace)
    now = [1000.0]
    series = EventSeries(window_s=600, similar_limit=3, clock=lambda: now[0])
    kube = Kube(await kr8s.asyncio.api(kubeconfig=str(cp.kubeconfig)), series)

    for _ in range(4):  # the same Event four times: one Event, count 4
        await kube.event(subject, reason="Woken", message="woken for 1 held request")
    (woken,) = events(cp, namespace, "Woken")
    assert woken["count"] == 4 and woken["message"] == "woken for 1 held request"

    for i in range(5):  # similar Events: 3 one by one, then one combined
        await kube.event(subject, reason="Slept", message=f"ACK t{i}: freed {i}Ki")
    slept = events(cp, namespace, "Slept")
    assert [e["message"] for e in slept[:3]] == [f"ACK t{i}: freed {i}Ki" for i in range(3)]
    combined = slept[3]
    assert len(slept) == 4 and combined["count"] == 2
    assert combined["message"] == COMBINED_PREFIX + "ACK t4: freed 4Ki"
    assert all(e["type"] == "Normal" for e in slept)

    # The API lost the combined Event (expired): the next one is created again, count 1.
    cp.kubectl("delete", "event", combined["metadata"]["name"], "-n", namespace)
    await kube.event(subject, reason="Slept", message="ACK t5: freed 5Ki")
    again = events(cp, namespace, "Slept")
    assert len(again) == 4 and again[3]["count"] == 1
    assert again[3]["message"] == COMBINED_PREFIX + "ACK t5: freed 5Ki"

    # A Warning is its own series; after the window a repeat is a new Event.
    await kube.event(subject, reason="Woken", message="woken for 1 held request", warning=True)
    now[0] += 601
    await kube.event(subject, reason="Woken", message="woken for 1 held request")
    woken_all = events(cp, namespace, "Woken")
    assert [(e["type"], e["count"]) for e in woken_all] == [
        ("Normal", 4), ("Warning", 1), ("Normal", 1),
    ]  # fmt: skip
