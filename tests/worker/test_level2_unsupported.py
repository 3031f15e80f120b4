"""Level 2 needs safetensors files: a component without them is kept on the host at level 2;
without any there is no level 2 (nothing to reload from)."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from omnistage.worker.v1 import types_pb2
from tests.worker.conftest import StartWorker


def _pickle(target: Path, component: str) -> None:
    """Save one component as a pickled state dict instead of safetensors."""
    for weights in (target / component).glob("*.safetensors"):
        name = "pytorch_model.bin" if weights.name == "model.safetensors" else None
        out = target / component / (name or weights.name.replace(".safetensors", ".bin"))
        torch.save(load_file(str(weights)), out)
        weights.unlink()


@pytest.fixture(scope="module")
def pickled_vae_dir(diffusion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline with its VAE saved as a pickled state dict instead of safetensors."""
    target = tmp_path_factory.mktemp("models") / "tiny-sd-bin-vae"
    shutil.copytree(diffusion_dir, target)
    _pickle(target, "vae")
    return target


@pytest.fixture(scope="module")
def pickled_dir(diffusion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline with no safetensors file at all."""
    target = tmp_path_factory.mktemp("models") / "tiny-sd-bin"
    shutil.copytree(diffusion_dir, target)
    for component in ("vae", "unet", "text_encoder"):
        _pickle(target, component)
    return target


async def test_level2_with_one_pickled_component(
    start_worker: StartWorker, pickled_vae_dir: Path
) -> None:
    worker = await start_worker(pickled_vae_dir, "diffusion", "diffusers")
    before = await worker.generate()
    assert (await worker.sleep(2)).ok
    status = await worker.status()
    assert status.level == types_pb2.SLEEP_LEVEL_DISCARD
    assert (await worker.wake()).ok
    assert (await worker.generate()).image.png == before.image.png


async def test_level2_refused_level1_works(start_worker: StartWorker, pickled_dir: Path) -> None:
    worker = await start_worker(pickled_dir, "diffusion", "diffusers")
    assert (await worker.status()).state == types_pb2.WORKER_STATE_ACTIVE
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.sleep(2)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (info.value.details() or "").startswith("level: 2 is not supported")
    assert (await worker.status()).state == types_pb2.WORKER_STATE_ACTIVE
    assert (await worker.sleep(1)).ok
    assert (await worker.wake()).ok


async def test_start_asleep_level2_fails_clearly(
    start_worker: StartWorker, pickled_dir: Path
) -> None:
    worker = await start_worker(
        pickled_dir, "diffusion", "diffusers", initial_state="asleep", sleep_level=2
    )
    status = await worker.status()
    assert status.state == types_pb2.WORKER_STATE_FAILED
    assert "--sleep-level 2 needs *.safetensors" in status.error
