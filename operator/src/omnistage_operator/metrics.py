"""Prometheus metrics of the operator (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "ACK_SECONDS",
    "BYTES_FREED",
    "FENCES",
    "HANDOVER_SECONDS",
    "LEADER",
    "LEADER_EPOCH",
    "LEADER_TRANSITIONS",
    "ROUNDS",
    "ROUND_API_OBJECTS",
    "ROUND_API_REQUESTS",
    "TRANSITIONS",
]

TRANSITIONS = Counter(
    "omnistage_transitions_total",
    "Sleep and wake transitions ordered by the operator, by operation and result.",
    ["namespace", "group", "op", "result"],
)
ACK_SECONDS = Histogram(
    "omnistage_ack_seconds",
    "Time from sending a Sleep or WakeUp to receiving its ACK.",
    ["op"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
HANDOVER_SECONDS = Histogram(
    "omnistage_handover_seconds",
    "Duration of a hand-over round that slept or woke at least one stage.",
    ["namespace", "group"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
BYTES_FREED = Counter(
    "omnistage_bytes_freed_total",
    "Device bytes freed by sleeps, as measured by the workers' ACKs.",
    ["namespace", "group"],
)
FENCES = Counter(
    "omnistage_fences_total",
    "Stages fenced (pod deleted and confirmed gone) after a failed or missing sleep ACK.",
    ["namespace", "group", "result"],
)
ROUNDS = Counter(
    "omnistage_rounds_total",
    "Arbitration rounds run, by outcome.",
    ["namespace", "group", "outcome"],
)
ROUND_API_REQUESTS = Counter(
    "omnistage_round_api_requests_total",
    "Kubernetes API requests made by the group's rounds (specs and pods come from the watches).",
    ["namespace", "group"],
)
ROUND_API_OBJECTS = Counter(
    "omnistage_round_api_objects_total",
    "Objects the group's rounds read from the Kubernetes API (GET: one; LIST: its items).",
    ["namespace", "group"],
)
LEADER = Gauge(
    "omnistage_leader",
    "1 while this replica holds the leader Lease and renewed it within the renew deadline.",
)
LEADER_EPOCH = Gauge(
    "omnistage_leader_epoch",
    "The epoch this replica's orders carry (the Lease's transition count when it acquired it).",
)
LEADER_TRANSITIONS = Counter(
    "omnistage_leader_transitions_total",
    "Changes of this replica's leadership, by direction (acquired, lost).",
    ["change"],
)
