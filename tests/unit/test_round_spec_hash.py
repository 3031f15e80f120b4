"""A round hashes each stage's pod spec once (``ListingPort.spec_hash``), not at every observe.

Every observe checks each worker pod against the digest of the spec it must be built from
(``pod_spec_hash``: a JSON dump and a SHA-256 of the spec's pod fields); a hand-over round
observes three times, and the hashing was a quarter of its CPU (py-spy over
``bench/operator_switch.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from omnistage_operator.k8s import port_facts, port_listing
from tests.unit.test_kept_readings import _port


async def test_a_rounds_observes_hash_each_spec_once(monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[str] = []

    def counted(spec: Any, profile: Any = None) -> str:
        hashed.append(spec.name)
        return "h"

    for module in (port_listing, port_facts):  # (before, the facts hashed it for themselves)
        monkeypatch.setattr(module, "pod_spec_hash", counted, raising=False)
    port, _ = _port(monkeypatch)
    for _ in range(3):  # before the plan, after the sleeps, after the wakes
        await port.observe()
    assert sorted(hashed) == ["ar", "sd"]  # before: six (one per stage per observe)
