"""The simulated GPU's physics (pure model) and its shared directory (records, faults, death)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from omnistage_worker.config import WorkerConfig
from omnistage_worker.memory import AccountingProbe, DeviceProbes, build_probe
from tests.fakegpu import model
from tests.fakegpu.device import FakeGpu
from tests.fakegpu.model import Device, Faults, GiB, MiB, OutOfMemory, Proc
from tests.fakegpu.probe import FakeGpuProbe, from_env

H100 = Device(uuid="GPU-h100", total=model.H100_TOTAL)


def test_defaults_follow_an_h100() -> None:
    assert H100.context == 612 * MiB
    assert 480 * MiB < H100.reserve < 500 * MiB  # idle free about 0.6% below total
    small = Device(uuid="GPU-s", total=1_100_000)
    assert 0 < small.context < small.total // 100 and 0 < small.reserve < small.context
    assert Device(uuid="x", total=GiB, activation=5).activation_bytes(10**6) == 5
    assert Device(uuid="x", total=GiB, activation=0.5).activation_bytes(10**6) == 500_000
    with pytest.raises(ValueError):
        Device(uuid="x", total=100, reserve=100)


def test_idle_device_is_below_total_and_a_context_is_charged_before_weights() -> None:
    assert model.free(H100, []) == H100.total - H100.reserve < H100.total
    a = model.touch(H100, Proc(1, 0.0), [])
    assert a.used == a.charged == 612 * MiB and a.weights == 0
    assert model.touch(H100, a, []) == a  # idempotent
    b = model.touch(H100, Proc(2, 0.0), [a])
    assert model.free(H100, [a, b]) == H100.total - H100.reserve - 2 * 612 * MiB
    crowded = model.with_weights(b, H100.total - H100.reserve - 612 * MiB - 100 * MiB)
    with pytest.raises(OutOfMemory, match=r"^CUDA out of memory\. Tried to allocate 612\.00 MiB"):
        model.touch(H100, Proc(3, 0.0), [crowded])


def test_serving_peaks_above_the_weights_and_the_pool_stays_until_release() -> None:
    me = model.with_weights(model.touch(H100, Proc(1, 0.0), []), 16 * GiB)
    awake = me.used
    serving, taken = model.serve_begin(H100, me, [])
    assert taken == 4 * GiB and serving.used == awake + 4 * GiB
    done = model.serve_end(serving, taken)
    assert done.in_use == 0 and done.used == awake + 4 * GiB  # the caching allocator keeps it
    again, taken2 = model.serve_begin(H100, done, [])
    assert again.used == done.used  # reused from the pool: no new allocation
    two, _ = model.serve_begin(H100, again, [])
    assert two.pool == 8 * GiB  # two requests at once need two sets of activations
    asleep = model.release_cached(
        model.with_weights(model.serve_end(model.serve_end(two, taken), taken2), 0),
        Faults(),
        freed_by_sleep=16 * GiB,
    )
    assert asleep.used == 612 * MiB and asleep.pool == 0


def test_activations_that_do_not_fit_raise_a_cuda_shaped_oom() -> None:
    dev = Device(uuid="GPU-s", total=10 * GiB, reserve=0, context=0)
    me = model.with_weights(Proc(1, 0.0), 4 * GiB)
    other = model.with_weights(Proc(2, 0.0), 5 * GiB + 512 * MiB)
    with pytest.raises(OutOfMemory, match=r"Tried to allocate 1\.00 GiB.*of which 512\.00 MiB is"):
        model.serve_begin(dev, me, [other])
    ok, _ = model.serve_begin(dev, me, [model.with_weights(other, 5 * GiB)])
    assert model.free(dev, [ok, model.with_weights(other, 5 * GiB)]) == 0


def test_leak_and_lie_faults() -> None:
    me = model.with_weights(model.touch(H100, Proc(1, 0.0), []), 8 * GiB)
    me, taken = model.serve_begin(H100, me, [])
    me = model.with_weights(model.serve_end(me, taken), 0)  # the sleep let the weights go
    leaky = model.release_cached(me, Faults(leak_on_sleep=GiB), freed_by_sleep=8 * GiB)
    assert leaky.used == leaky.charged == 612 * MiB + GiB
    liar = model.release_cached(me, Faults(leak_on_sleep=GiB, lie=True), freed_by_sleep=8 * GiB)
    assert liar.used == 612 * MiB and liar.charged == 612 * MiB + GiB
    assert model.free(H100, [liar]) == model.free(H100, [leaky])  # the device still holds it
    everything = model.release_cached(me, Faults(leak_on_sleep=-1, lie=True), 8 * GiB)
    assert everything.used == 612 * MiB and everything.hidden == 10 * GiB
    capped = model.release_cached(me, Faults(leak_on_sleep=100 * GiB), freed_by_sleep=8 * GiB)
    assert capped.leaked == 10 * GiB  # a sleep cannot leave more than it held
    twice = model.release_cached(leaky, Faults(leak_on_sleep=GiB), freed_by_sleep=GiB)
    assert twice.leaked == 2 * GiB  # leaks accumulate over sleeps


def test_faults_table_merges_all_then_pid() -> None:
    table = {
        "*": {"slow_serving_s": 2, "leak_on_sleep": 5},
        "42": {"lie": True, "leak_on_sleep": "all"},
    }
    assert Faults.for_pid(table, 7) == Faults(leak_on_sleep=5, slow_serving_s=2.0)
    assert Faults.for_pid(table, 42) == Faults(leak_on_sleep=-1, lie=True, slow_serving_s=2.0)
    assert Faults.for_pid({}, 1) == Faults()


@pytest.fixture
def other_process() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_processes_share_the_directory_and_a_dead_process_frees_its_memory(
    tmp_path: Path, other_process: subprocess.Popen[bytes]
) -> None:
    gpu = FakeGpu.create(
        tmp_path / "gpu", Device(uuid="GPU-t", total=100 * MiB, reserve=MiB, context=2 * MiB)
    )
    mine = FakeGpuProbe(gpu, lambda: 10 * MiB)
    theirs = FakeGpuProbe(gpu, lambda: 20 * MiB, pid=other_process.pid)
    assert mine.read().free == 99 * MiB - 10 * MiB  # not touched yet: weights only
    mine.touch()
    theirs.touch()
    reading = theirs.read()  # publishes its weights
    assert reading.devices[0].used == 22 * MiB and reading.devices[0].uuid == "GPU-t"
    assert mine.read().free == 99 * MiB - 12 * MiB - 22 * MiB == gpu.snapshot().free
    other_process.kill()
    other_process.wait()
    deadline = time.monotonic() + 10
    while mine.read().free != 99 * MiB - 12 * MiB and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mine.read().free == 99 * MiB - 12 * MiB
    mine.close()
    assert gpu.snapshot().procs == {}


def test_only_live_processes_count(tmp_path: Path, other_process: subprocess.Popen[bytes]) -> None:
    """A record counts while its process lives: not a dead pid's, not garbage, not after exit."""
    gpu = FakeGpu.create(tmp_path / "gpu", Device(uuid="GPU-t", total=GiB, reserve=0, context=0))
    mine = FakeGpuProbe(gpu, lambda: 100)
    theirs = FakeGpuProbe(gpu, lambda: 40, pid=other_process.pid)
    mine.read(), theirs.read()  # each publishes its weights
    assert mine.read().free == GiB - 140
    (gpu.procs_dir / "999999999.json").write_text(  # a dead pid
        '{"pid": 999999999, "create_time": 0, "weights": 7}'
    )
    (gpu.procs_dir / "garbage.json").write_text("x")
    assert mine.read().free == GiB - 140
    other_process.kill()
    other_process.wait()
    assert mine.read().free == GiB - 100  # the other process died without withdrawing
    mine.close()
    assert not (gpu.procs_dir / f"{mine.pid}.json").exists()


def test_probe_faults_switch_at_run_time(tmp_path: Path) -> None:
    gpu = FakeGpu.create(tmp_path / "gpu", Device(uuid="GPU-t", total=GiB, reserve=0, context=MiB))
    weights = [100 * MiB]
    probe = FakeGpuProbe(gpu, lambda: weights[0])
    probe.touch()
    with probe.serving():
        assert probe.read().used == MiB + 125 * MiB
    gpu.set_faults(slow_serving_s=0.2)
    started = time.monotonic()
    with probe.serving():
        pass
    assert time.monotonic() - started >= 0.2
    gpu.set_faults(pid=probe.pid, leak_on_sleep=10 * MiB, lie=True)
    weights[0] = 0
    probe.release_cached()
    assert probe.read().used == MiB  # the process's own figure says all is free...
    assert probe.read().free == GiB - 11 * MiB  # ...but the device holds the leak
    gpu.set_faults(slow_serving_s=None)
    assert gpu.faults(probe.pid) == Faults(leak_on_sleep=10 * MiB, lie=True)
    gpu.clear_faults()
    assert gpu.faults(probe.pid) == Faults()


def test_build_probe_seam(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = WorkerConfig(runner="ar", backend="transformers", model=tmp_path)
    assert isinstance(build_probe(config, env={}), AccountingProbe)
    FakeGpu.create(tmp_path / "gpu", Device(uuid="GPU-t", total=GiB))
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", str(tmp_path / "gpu"))
    probe = build_probe(config, env={"OMNISTAGE_MEMORY_PROBE": "tests.fakegpu.probe:from_env"})
    assert isinstance(probe, FakeGpuProbe) and probe.device.uuid == "GPU-t"
    with pytest.raises(ValueError, match="module:factory"):
        build_probe(config, env={"OMNISTAGE_MEMORY_PROBE": "tests.fakegpu.probe"})
    monkeypatch.delenv("OMNISTAGE_FAKE_GPU")
    with pytest.raises(ValueError, match="OMNISTAGE_FAKE_GPU is not set"):
        from_env(config)


def test_seam_gives_a_probe_per_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    dirs = [tmp_path / f"gpu{i}" for i in range(3)]
    for i, d in enumerate(dirs):
        FakeGpu.create(d, Device(uuid=f"GPU-{i}", index=i, total=GiB))
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", ",".join(map(str, dirs)))
    two = WorkerConfig(runner="ar", backend="transformers", model=tmp_path, gpus=2)
    probe = from_env(two)
    assert isinstance(probe, DeviceProbes)  # the first --gpus of the devices the pod sees
    probe.set_used_fns([lambda: 5 * MiB, lambda: 7 * MiB])
    probe.touch()
    reading = probe.read()
    assert [(d.device, d.uuid) for d in reading.devices] == [
        ("cuda:0", "GPU-0"),
        ("cuda:1", "GPU-1"),
    ]
    context = Device(uuid="x", total=GiB).context
    assert [d.used for d in reading.devices] == [context + 5 * MiB, context + 7 * MiB]
    assert reading.used == sum(d.used for d in reading.devices)
    probe.close()
    one = WorkerConfig(runner="ar", backend="transformers", model=tmp_path)
    assert isinstance(from_env(one), FakeGpuProbe)
    monkeypatch.setenv("OMNISTAGE_FAKE_GPU", str(dirs[0]))
    with pytest.raises(ValueError, match="lists 1 device"):
        from_env(two)
