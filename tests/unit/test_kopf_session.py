"""How many connections kopf may hold (``kopf_session.connection_limit``): its requests' share
plus a stream per watch of each served namespace; unbounded for namespace patterns."""

from __future__ import annotations

import pytest

from omnistage_operator.k8s.kopf_session import (
    CLUSTER_STREAMS,
    REQUEST_CONNECTIONS,
    STREAMS_PER_NAMESPACE,
    connection_limit,
)


def test_the_whole_cluster_counts_as_one_namespace() -> None:
    one = REQUEST_CONNECTIONS + STREAMS_PER_NAMESPACE + CLUSTER_STREAMS
    assert connection_limit(()) == connection_limit(("team-a",)) == one


def test_every_served_namespace_adds_its_watches() -> None:
    three = connection_limit(("a", "b", "c"))
    assert three - connection_limit(("a",)) == 2 * STREAMS_PER_NAMESPACE


@pytest.mark.parametrize("pattern", ["team-*", "team-?", "!kube-system", "a,b", "team-[ab]"])
def test_a_namespace_pattern_leaves_kopf_unbounded(pattern: str) -> None:
    assert connection_limit(("plain", pattern)) == 0
