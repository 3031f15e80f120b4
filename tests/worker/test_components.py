"""Component-level sleep: components discovered (or declared), each with its own buffers; Sleep
naming components keeps the worker Active; sequential mode keeps one component resident."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.engine.components import ComponentEngine, plan_groups
from omnistage_worker.runners.components import ComponentError, discover
from omnistage_worker.runners.diffusion import DiffusionRunner
from tests.worker.conftest import StartWorker

ENCODERS = ("text_encoder", "text_encoder_2")
P = inference_service_pb2.ParameterValue
REQUEST: dict[str, Any] = {
    "height": 32,
    "width": 32,
    "num_inference_steps": 2,
    "parameters": {"max_sequence_length": P(int_value=8)},
}


def _image(pipe: Any) -> torch.Tensor:
    out = pipe(
        "the cat sat",
        height=32,
        width=32,
        num_inference_steps=2,
        max_sequence_length=8,
        output_type="pt",
        generator=torch.Generator().manual_seed(3),
    )
    images: torch.Tensor = out.images
    return images


def _runner(flux_dir: Path, **config: Any) -> DiffusionRunner:
    runner = DiffusionRunner(
        WorkerConfig(runner="diffusion", backend="diffusers", model=flux_dir, **config)
    )
    runner.load()
    return runner


def test_groups_merge_shared_tensors_and_skip_nested() -> None:
    shared = torch.nn.Linear(4, 4)
    a = torch.nn.Sequential(shared, torch.nn.Linear(4, 2))
    b = torch.nn.Sequential(torch.nn.Linear(2, 2), shared)
    c = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    groups = plan_groups({"a": a, "b": b, "c": c, "c.1": c[1]})
    assert [(g.name, g.skip) for g in groups] == [
        ("a+b", ()),
        ("c", (("c", "1"),)),
        ("c.1", ()),
    ]
    engine = ComponentEngine({"c": c, "c.1": c[1]}, torch.device("cpu"))
    assert engine.weights_bytes == sum(p.numel() * 4 for p in c.parameters())  # not twice
    engine.activate()
    engine.sleep_components(["c.1"], 1)
    inner, outer = c[1], c[0]
    assert isinstance(inner, torch.nn.Linear) and isinstance(outer, torch.nn.Linear)
    assert inner.weight.numel() == 0 and outer.weight.numel() == 9  # only the nested one moved
    engine.wake()
    assert inner.weight.shape == (3, 3)
    engine.close()


def test_declared_components(flux_dir: Path) -> None:
    runner = _runner(flux_dir)
    pipe = runner.pipeline
    found = discover(pipe, runner.modules(), ["transformer.transformer_blocks.0", "vae.decoder"])
    assert list(found)[:2] == ["transformer.transformer_blocks.0", "vae.decoder"]
    assert set(found) >= {"transformer", "text_encoder", "text_encoder_2", "vae"}
    with pytest.raises(ComponentError, match=r"has no 'transformer\.nope'"):
        discover(pipe, runner.modules(), ["transformer.nope"])
    with pytest.raises(ComponentError, match="is a FlowMatchEulerDiscreteScheduler"):
        discover(pipe, runner.modules(), ["scheduler"])


def test_component_sleep_keeps_the_rest_bit_identical(flux_dir: Path) -> None:
    runner = _runner(flux_dir)
    engine = runner.build_controller()
    assert isinstance(engine, ComponentEngine)
    engine.activate()
    before = _image(runner.pipeline)
    engine.sleep_components(ENCODERS, 1)
    figures = {f.name: f for f in engine.figures()}
    assert set(figures) == {"transformer", "vae", *ENCODERS}
    for name in ENCODERS:
        assert (figures[name].level, figures[name].device_bytes) == (1, 0)
    for name in ("transformer", "vae"):  # resident: the flat buffer, alignment included
        assert figures[name].level == 0
        assert 0 <= figures[name].device_bytes - figures[name].weights_bytes < 64 * 1024
    assert engine.level == 0 and engine.asleep() == list(ENCODERS)
    engine.wake()
    assert torch.equal(_image(runner.pipeline), before)
    engine.sleep_components(["text_encoder_2"], 2)  # reloaded from its files
    engine.wake()
    assert torch.equal(_image(runner.pipeline), before)
    engine.close()


def test_sequential_mode_keeps_one_component_resident(flux_dir: Path) -> None:
    reference = _runner(flux_dir)
    ref_engine = reference.build_controller()
    ref_engine.activate()
    expected = _image(reference.pipeline)
    runner = _runner(flux_dir, sequential=True)
    engine = runner.build_controller()
    assert isinstance(engine, ComponentEngine)
    engine.activate()
    sizes = {name: e.flat_bytes for name, e in engine.engines.items()}
    resident: list[int] = []
    swaps: list[str] = []
    use = engine.use

    def tracking_use(group: str) -> None:
        use(group)
        swaps.append(group)
        resident.append(engine.device_bytes())

    engine.use = tracking_use  # type: ignore[method-assign]
    assert torch.equal(_image(runner.pipeline), expected)
    assert resident[-1] == sizes["vae"]  # one component resident at a time
    assert max(resident) == max(sizes.values()) < sum(sizes.values())
    ordered = [g for i, g in enumerate(swaps) if i == 0 or swaps[i - 1] != g]
    assert ordered == ["text_encoder", "text_encoder_2", "transformer", "vae"]
    assert torch.equal(_image(runner.pipeline), expected)  # and again, after swapping back
    engine.close()
    assert isinstance(ref_engine, ComponentEngine)
    ref_engine.close()


async def test_worker_component_sleep(start_worker: StartWorker, flux_dir: Path) -> None:
    worker = await start_worker(flux_dir, "diffusion", "diffusers")
    before = await worker.generate(**REQUEST)
    status = await worker.status()
    total = {c.name: c.device_bytes for c in status.components}
    assert set(total) == {"transformer", "vae", *ENCODERS}
    assert all(c.level == types_pb2.SLEEP_LEVEL_UNSPECIFIED for c in status.components)
    ack = await worker.sleep(1, components=ENCODERS)
    assert ack.ok and ack.state == types_pb2.WORKER_STATE_ACTIVE
    parts = {c.name: c for c in ack.components}
    assert all(parts[n].device_bytes == 0 for n in ENCODERS)
    assert parts["transformer"].device_bytes == total["transformer"]
    assert parts["text_encoder"].level == types_pb2.SLEEP_LEVEL_OFFLOAD
    assert ack.freed_bytes == sum(total[n] for n in ENCODERS)
    status = await worker.status()
    assert status.state == types_pb2.WORKER_STATE_ACTIVE
    assert status.active_footprint_bytes == ack.used_after_bytes
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.generate(**REQUEST)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "components asleep: text_encoder, text_encoder_2" in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.sleep(1, components=("unet",))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (info.value.details() or "").startswith("components: unknown component 'unet'")
    woke = await worker.wake()
    assert woke.ok and not woke.noop and woke.bytes_moved == ack.bytes_moved
    assert (await worker.generate(**REQUEST)).image.png == before.image.png
    assert (await worker.sleep(1)).ok  # the whole stage still sleeps as one
    assert (await worker.status()).state == types_pb2.WORKER_STATE_ASLEEP


async def test_worker_sequential(start_worker: StartWorker, flux_dir: Path) -> None:
    plain = await start_worker(flux_dir, "diffusion", "diffusers")
    expected = (await plain.generate(**REQUEST)).image.png
    worker = await start_worker(flux_dir, "diffusion", "diffusers", sequential=True)
    status = await worker.status()
    assert status.sequential
    largest = max(c.weights_bytes for c in status.components)
    assert status.active_footprint_bytes <= largest + 1024 * 1024
    assert (await worker.generate(**REQUEST)).image.png == expected
    assert (await worker.sleep(1)).ok
    assert (await worker.wake()).ok
    assert (await worker.generate(**REQUEST)).image.png == expected
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.sleep(1, components=("vae",))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_component_flags(tmp_path: Path) -> None:
    from omnistage_worker.cli import build_parser, config_from_args
    from omnistage_worker.config import ConfigError

    base = ["--runner", "diffusion", "--backend", "diffusers", "--model", str(tmp_path)]
    args = build_parser({}).parse_args(
        [*base, "--variant", "fp16", "--components", "transformer, text_encoder_2", "--sequential"]
    )
    config = config_from_args(args)
    assert config.variant == "fp16"
    assert config.components == ("transformer", "text_encoder_2")
    assert config.sequential
    for extra, flag in (
        (["--variant", "fp16.x"], "--variant"),
        (["--components", "transformer,2bad"], "--components"),
        (["--components", "vae,vae"], "--components"),
    ):
        with pytest.raises(ConfigError) as info:
            config_from_args(build_parser({}).parse_args([*base, *extra]))
        assert info.value.flag == flag
    with pytest.raises(ConfigError) as info:
        WorkerConfig(runner="ar", backend="transformers", model=tmp_path, sequential=True)
    assert info.value.flag == "--sequential"


async def test_arbiter_admits_beside_a_partly_asleep_stage(
    start_worker: StartWorker, flux_dir: Path
) -> None:
    """The operator's arbiter reads the partly asleep worker's GetStatus: its footprint is what
    stays resident, so a second stage the size of the sleeping encoders fits beside it."""
    from omnistage_operator.decisions.arbiter import GroupMemory, StageIntent, WorkerPhase
    from omnistage_operator.decisions.arbiter.plan import plan
    from omnistage_operator.decisions.facts import report_from_proto

    worker = await start_worker(flux_dir, "diffusion", "diffusers")
    await worker.generate(**REQUEST)  # the peak while serving
    full = await worker.status()
    encoders = sum(c.device_bytes for c in full.components if c.name in ENCODERS)
    capacity = full.peak_active_bytes + encoders // 2  # a second stage of encoders' size: no room
    intents = {
        "flux": StageIntent("flux", True, requested_active_at=2),  # the latest ask goes first
        "other": StageIntent("other", True, requested_active_at=1, vram_request=encoders),
    }
    other = report_from_proto(
        type(full)(state=types_pb2.WORKER_STATE_ASLEEP, level=types_pb2.SLEEP_LEVEL_OFFLOAD)
    )

    def admitted(status: Any) -> set[str]:
        facts = {"flux": report_from_proto(status).stage_facts(), "other": other.stage_facts()}
        assert facts["flux"].phase is WorkerPhase.ACTIVE
        free = capacity - status.used_bytes
        return set(plan(intents, facts, GroupMemory(capacity, free)).admitted)

    assert admitted(full) == {"flux"}
    assert (await worker.sleep(1, components=ENCODERS)).ok
    partly = await worker.status()
    assert partly.active_footprint_bytes == partly.peak_active_bytes == partly.used_bytes
    assert partly.used_bytes <= full.used_bytes - encoders
    assert admitted(partly) == {"flux", "other"}


def test_sequential_swaps_reuse_a_valid_host_copy() -> None:
    from omnistage_worker.engine import WeightEngine

    model = torch.nn.Linear(32, 32)
    before = model.weight.detach().clone()
    engine = WeightEngine({"m": model}, torch.device("cpu"), pin_in_background=False)
    engine.activate()
    assert engine.sleep(1, reuse_host=True).bytes_moved > 0  # no valid host copy yet: copied
    engine.wake()
    assert engine.sleep(1, reuse_host=True).bytes_moved == 0  # the same bytes are on the host
    engine.wake()
    assert torch.equal(model.weight, before)
    assert engine.sleep(1).bytes_moved > 0  # without the promise: copied as always
    engine.close()
