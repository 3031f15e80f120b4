"""The fast vLLM sleep/wake's plan (issue 23): which allocations are copied, discarded or mapped,
where their backups sit in the kept host buffer, and the order of the steps."""

from __future__ import annotations

import pytest

from omnistage_worker.runners.vllm_wake_plan import (
    ALIGN,
    WAKE_ORDERS,
    Allocation,
    Backup,
    Phases,
    offload_tags_of,
    phase_of,
    plan_sleep,
    plan_wake,
    reuse_buffer,
    sleep_steps,
    wake_steps,
)

MiB = 1 << 20
ALLOCS = [
    Allocation(0x1000_0000, 4 * MiB, "weights"),
    Allocation(0x2000_0000, 100, "weights"),  # not a multiple of ALIGN: the next one is aligned
    Allocation(0x3000_0000, 64 * MiB, "kv_cache"),
    Allocation(0x4000_0000, 2 * MiB, "weights"),
]


def test_offload_tags_read_as_vllm_reads_them() -> None:
    assert offload_tags_of(None) == ("default",)
    assert offload_tags_of("weights") == ("weights",)
    assert offload_tags_of(("weights",)) == ("weights",)
    assert offload_tags_of(()) == ()


def test_level1_sleep_backs_up_the_weights_and_discards_the_kv_cache() -> None:
    plan = plan_sleep(ALLOCS, ("weights",))
    assert plan.backups == (
        Backup(0x1000_0000, 4 * MiB, 0),
        Backup(0x2000_0000, 100, 4 * MiB),
        Backup(0x4000_0000, 2 * MiB, 4 * MiB + ALIGN),
    )
    assert plan.discard == (0x3000_0000,)
    assert plan.total_bytes == 70 * MiB + 100
    assert plan.backup_bytes == 6 * MiB + 100
    assert plan.buffer_bytes == 6 * MiB + ALIGN
    assert all(b.offset % ALIGN == 0 for b in plan.backups)


def test_level2_sleep_backs_up_nothing() -> None:
    plan = plan_sleep(ALLOCS, ())
    assert plan.backups == () and plan.buffer_bytes == 0
    assert plan.discard == tuple(a.ptr for a in ALLOCS)
    # vLLM's default (no tags given) offloads the "default" tag only
    assert plan_sleep(ALLOCS, None).backups == ()


def test_wake_maps_the_woken_tags_and_copies_only_what_has_a_backup() -> None:
    backups = {b.ptr: b for b in plan_sleep(ALLOCS, ("weights",)).backups}
    full = plan_wake(ALLOCS, None, backups)
    assert [b.ptr for b in full.copies] == [0x1000_0000, 0x2000_0000, 0x4000_0000]
    assert full.maps_only == (0x3000_0000,)
    assert full.copy_bytes == 6 * MiB + 100
    # level 2's partial wakes: the weights (no backups: mapped only), then the KV cache
    assert plan_wake(ALLOCS, ["weights"], {}).maps_only == (0x1000_0000, 0x2000_0000, 0x4000_0000)
    kv = plan_wake(ALLOCS, ["kv_cache"], backups)
    assert kv.copies == () and kv.maps_only == (0x3000_0000,)
    # a backup whose allocation changed size is not copied into it
    changed = [Allocation(0x1000_0000, 8 * MiB, "weights")]
    assert plan_wake(changed, None, backups).maps_only == (0x1000_0000,)


def test_the_kept_buffer_is_reused_when_it_fits() -> None:
    assert reuse_buffer(10, 10) and reuse_buffer(10, 4)
    assert not reuse_buffer(None, 10)  # none yet: allocate
    assert not reuse_buffer(10, 11)  # too small: give back, allocate the new size
    assert not reuse_buffer(10, 0)  # nothing to back up (level 2): give back


def test_sleep_issues_every_copy_releases_the_discarded_then_waits_once() -> None:
    steps = sleep_steps(plan_sleep(ALLOCS, ("weights",)))
    ops = [(s.op, s.ptr) for s in steps]
    assert ops == [
        ("sync_device", 0),
        ("copy_d2h", 0x1000_0000), ("copy_d2h", 0x2000_0000), ("copy_d2h", 0x4000_0000),
        ("release", 0x3000_0000),
        ("sync_copies", 0),
        ("release", 0x1000_0000), ("release", 0x2000_0000), ("release", 0x4000_0000),
    ]  # fmt: skip
    assert [s.op for s in sleep_steps(plan_sleep(ALLOCS, ()))].count("sync_copies") == 0


def test_wake_issues_each_copy_after_its_map_and_maps_the_kv_cache_before_the_one_wait() -> None:
    backups = {b.ptr: b for b in plan_sleep(ALLOCS, ("weights",)).backups}
    steps = wake_steps(plan_wake(ALLOCS, None, backups))
    ops = [(s.op, s.ptr) for s in steps]
    assert ops == [
        ("map", 0x1000_0000), ("copy_h2d", 0x1000_0000),
        ("map", 0x2000_0000), ("copy_h2d", 0x2000_0000),
        ("map", 0x4000_0000), ("copy_h2d", 0x4000_0000),
        ("map", 0x3000_0000),
        ("sync_copies", 0),
    ]  # fmt: skip
    backed = frozenset(backups)
    assert [phase_of(s, backed) for s in steps][-2:] == ["map_kv", "sync"]
    assert phase_of(steps[0], backed) == "map_weights"
    assert phase_of(steps[1], backed) == "copies_issued"


def test_phases_add_up_and_give_the_copy_rate() -> None:
    p = Phases("wake")
    p.add("map_weights", 0.1)
    p.add("sync", 0.3)
    p.add("map_weights", 0.1)
    p.copy_bytes = 10**9
    out = p.as_json()
    assert out["seconds"] == {"map_weights": 0.2, "sync": 0.3}
    assert out["total_seconds"] == 0.5 and out["copy_gbps"] == 2.0


def test_map_first_maps_everything_before_the_copies() -> None:
    backups = {b.ptr: b for b in plan_sleep(ALLOCS, ("weights",)).backups}
    steps = wake_steps(plan_wake(ALLOCS, None, backups), "map_first")
    assert [s.op for s in steps] == ["map"] * 4 + ["copy_h2d"] * 3 + ["sync_copies"]


def test_kv_after_maps_the_rest_once_the_copies_are_done() -> None:
    backups = {b.ptr: b for b in plan_sleep(ALLOCS, ("weights",)).backups}
    plan = plan_wake(ALLOCS, None, backups)
    steps = wake_steps(plan, "kv_after")
    assert [s.op for s in steps] == ["map", "copy_h2d"] * 3 + ["sync_copies", "map"]
    assert steps[-1].ptr in plan.maps_only
    # every order maps each allocation once and copies each backup once
    for order in WAKE_ORDERS:
        ops = [(s.op, s.ptr) for s in wake_steps(plan, order)]
        assert sorted(p for op, p in ops if op == "map") == sorted(a.ptr for a in ALLOCS)
        assert sorted(p for op, p in ops if op == "copy_h2d") == sorted(backups)
    with pytest.raises(ValueError, match="none of overlap, map_first, kv_after"):
        wake_steps(plan, "sideways")
