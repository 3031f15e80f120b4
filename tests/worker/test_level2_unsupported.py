"""Without safetensors files for every module there is no level 2 (nothing to reload from)."""

from __future__ import annotations

import shutil
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import load_file

from omnistage.worker.v1 import types_pb2
from tests.worker.conftest import StartWorker


@pytest.fixture(scope="module")
def pickled_vae_dir(diffusion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline with its VAE saved as a pickled state dict instead of safetensors."""
    target = tmp_path_factory.mktemp("models") / "tiny-sd-bin-vae"
    shutil.copytree(diffusion_dir, target)
    weights = target / "vae" / "diffusion_pytorch_model.safetensors"
    torch.save(load_file(str(weights)), target / "vae" / "diffusion_pytorch_model.bin")
    weights.unlink()
    return target


async def test_level2_refused_level1_works(
    start_worker: StartWorker, pickled_vae_dir: Path
) -> None:
    worker = await start_worker(pickled_vae_dir, "diffusion", "diffusers")
    assert (await worker.status()).state == types_pb2.WORKER_STATE_ACTIVE
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await worker.sleep(2)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert (info.value.details() or "").startswith("level: 2 is not supported")
    assert (await worker.status()).state == types_pb2.WORKER_STATE_ACTIVE
    assert (await worker.sleep(1)).ok
    assert (await worker.wake()).ok


async def test_start_asleep_level2_fails_clearly(
    start_worker: StartWorker, pickled_vae_dir: Path
) -> None:
    worker = await start_worker(
        pickled_vae_dir, "diffusion", "diffusers", initial_state="asleep", sleep_level=2
    )
    status = await worker.status()
    assert status.state == types_pb2.WORKER_STATE_FAILED
    assert "--sleep-level 2 needs *.safetensors" in status.error
