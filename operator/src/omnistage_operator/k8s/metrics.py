"""Prometheus metrics of the operator (served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "ACK_SECONDS",
    "ACK_VERDICTS",
    "API_REQUEST_SECONDS",
    "API_WAIT_SECONDS",
    "BYTES_FREED",
    "DEMAND_SWAPS",
    "DEMAND_WAKES",
    "DEVICE_FREE",
    "DEVICE_TOTAL",
    "FENCES",
    "HANDOVER_SECONDS",
    "HELD_REQUESTS",
    "HELD_SERVED",
    "HELD_TIMED_OUT",
    "HOLD_QUEUE_FULL",
    "HOLD_SECONDS",
    "IDLE_SLEEPS",
    "LEADER",
    "LEADER_EPOCH",
    "LEADER_TRANSITIONS",
    "NAMESPACE_CLAIMED_BY",
    "NAMESPACE_CLAIM_HELD",
    "ROUNDS",
    "ROUND_API_OBJECTS",
    "ROUND_API_REQUESTS",
    "ROUND_KICKS",
    "RUNNER_ENTRIES",
    "STAGE_DEVICE_USED",
    "STAGE_SLEEP_LEVEL",
    "STAGE_STATE",
    "STAGE_WAITING",
    "TRANSITIONS",
    "WAITS",
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
ROUND_KICKS = Counter(
    "omnistage_round_kicks_total",
    "Rounds asked for, by what asked first (kicks that join a round already asked are not"
    " counted): event, pod, resync, busy, error, retry, demand, sleep, leading, claim.",
    ["cause"],
)
ROUNDS_FROM_KEPT = Counter(
    "omnistage_rounds_from_kept_readings_total",
    "Rounds whose sleeps went out from the group's kept readings (no GetStatus before them).",
    ["namespace", "group"],
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
_API_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
API_WAIT_SECONDS = Histogram(
    "omnistage_api_wait_seconds",
    "Time a Kubernetes API request waited for one of the operator's request slots (a storm "
    "queues here, not in the HTTP pool), by lane (event: Events; request: the rest).",
    ["lane"],
    buckets=_API_BUCKETS,
)
API_REQUEST_SECONDS = Histogram(
    "omnistage_api_request_seconds",
    "Time the Kubernetes API server took to answer the operator's request, by verb.",
    ["verb"],
    buckets=_API_BUCKETS,
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
RUNNER_ENTRIES = Gauge(
    "omnistage_runner_entries",
    "Entries the operator keeps in memory, by scope: stage (facts of a stage across rounds), "
    "group (loops, kept readings, sleep trackers), channel (open worker channels), demand "
    "(demand streams and recheck timers). They follow the stages that exist.",
    ["scope"],
)

HELD_REQUESTS = Gauge(
    "omnistage_held_requests",
    "Requests an OnDemand stage's worker holds now, waiting for the stage to wake.",
    ["namespace", "stage"],
)
HOLD_SECONDS = Counter(
    "omnistage_hold_seconds_total",
    "Time held requests waited before they were served, summed (divide by "
    "omnistage_held_requests_served_total for the mean hold time).",
    ["namespace", "stage"],
)
HELD_SERVED = Counter(
    "omnistage_held_requests_served_total",
    "Held requests served once their stage was awake.",
    ["namespace", "stage"],
)
HELD_TIMED_OUT = Counter(
    "omnistage_held_requests_timed_out_total",
    "Held requests answered UNAVAILABLE / 503 at their hold timeout.",
    ["namespace", "stage"],
)
HOLD_QUEUE_FULL = Counter(
    "omnistage_hold_queue_full_total",
    "Requests refused at once because the stage's hold queue was full.",
    ["namespace", "stage"],
)
DEMAND_WAKES = Counter(
    "omnistage_demand_wakes_total",
    "Stages woken because requests were held for them.",
    ["namespace", "group"],
)
DEMAND_SWAPS = Counter(
    "omnistage_demand_swaps_total",
    "Hand-overs caused by demand: a stage woken for held requests after another one slept.",
    ["namespace", "group"],
)
IDLE_SLEEPS = Counter(
    "omnistage_idle_sleeps_total",
    "OnDemand stages put to sleep because they served no request for idleAfter.",
    ["namespace", "group"],
)

# Per stage and per device (omnistage_operator.runtime.stage_metrics keeps them in step with
# status).
ACK_VERDICTS = Counter(
    "omnistage_ack_verdicts",
    "Sleep and wake ACKs by what they proved: sleep ok, contradicted (ok, but the device's own "
    "figures disagree), failed, refused, no_ack; wake ok, out_of_memory, failed.",
    ["namespace", "group", "op", "verdict"],
)
STAGE_STATE = Gauge(
    "omnistage_stage_state",
    "1 for the state the stage's status reports (Pending, Loading, Active, Sleeping, Asleep, "
    "Waking, Waiting, Failed), 0 for the others.",
    ["namespace", "group", "stage", "state"],
)
STAGE_WAITING = Gauge(
    "omnistage_stage_waiting",
    "1 while the stage waits to become Active, labelled with status.waitReason.",
    ["namespace", "group", "stage", "reason"],
)
WAITS = Counter(
    "omnistage_waits",
    "Times a stage began to wait (or its wait reason changed), by reason.",
    ["namespace", "group", "reason"],
)
STAGE_SLEEP_LEVEL = Gauge(
    "omnistage_stage_sleep_level",
    "The stage's sleep level from its status (0: awake).",
    ["namespace", "group", "stage"],
)
STAGE_DEVICE_USED = Gauge(
    "omnistage_stage_device_used_bytes",
    "Device memory the stage's worker uses, per device (status.devices).",
    ["namespace", "group", "stage", "device"],
)
DEVICE_FREE = Gauge(
    "omnistage_device_free_bytes",
    "Free memory of a device (uuid, else index) as its stages' workers last measured it.",
    ["device"],
)
DEVICE_TOTAL = Gauge(
    "omnistage_device_total_bytes",
    "Total memory of a device (uuid, else index).",
    ["device"],
)
NAMESPACE_CLAIM_HELD = Gauge(
    "omnistage_namespace_claim_held",
    "1 while this replica's shard holds the namespace's claim (renewed within the renew "
    "deadline): only then are that namespace's workers ordered.",
    ["namespace"],
)
NAMESPACE_CLAIMED_BY = Gauge(
    "omnistage_namespace_claimed_by_other_shard",
    "1 while this shard's rounds in the namespace wait because another shard (its holder: "
    "<lease namespace>/<lease name>#<leader>) holds the namespace's claim.",
    ["namespace", "holder"],
)
