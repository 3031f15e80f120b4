"""Weight files chosen like the loaders choose them; ``dtype: auto`` from configs and headers;
level-2 stages keep no host copy; an asleep start stays near the model's size in host RAM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from omnistage_worker.config import WorkerConfig
from omnistage_worker.engine import WeightEngine
from omnistage_worker.runners.diffusion import DiffusionRunner
from omnistage_worker.runners.dtypes import dtype_from_config, dtype_from_headers, resolve_dtype
from omnistage_worker.runners.weight_files import (
    WeightFileError,
    choose_from_names,
    weight_files_in,
)

SDXL_UNET = [
    "config.json",
    "diffusion_pytorch_model.safetensors",
    "diffusion_pytorch_model.fp16.safetensors",
]


def test_variant_folder_takes_one_file() -> None:
    assert choose_from_names(SDXL_UNET, None) == ("diffusion_pytorch_model.safetensors",)
    assert choose_from_names(SDXL_UNET, "fp16") == ("diffusion_pytorch_model.fp16.safetensors",)
    # a variant the folder lacks: the loaders fall back to the non-variant file
    assert choose_from_names(SDXL_UNET, "bf16") == ("diffusion_pytorch_model.safetensors",)


def test_index_wins_and_variant_shards() -> None:
    names = [
        "model.safetensors.index.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.fp16.json",
        "model.fp16-00001-of-00002.safetensors",
        "model.fp16-00002-of-00002.safetensors",
    ]
    assert choose_from_names(names, None) == ("model.safetensors.index.json",)
    assert choose_from_names(names, "fp16") == ("model.safetensors.index.fp16.json",)
    shards = [n for n in names if "index" not in n]
    assert choose_from_names(shards, None) == tuple(shards[:2])
    assert choose_from_names(shards, "fp16") == tuple(shards[2:])
    with pytest.raises(WeightFileError, match="several weight files"):
        choose_from_names(["a.safetensors", "b.safetensors"], None)
    assert choose_from_names(["config.json"], None) == ()


def test_index_resolved_to_its_shards(tmp_path: Path) -> None:
    for shard in ("m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors"):
        save_file({"w": torch.zeros(2)}, str(tmp_path / shard))
    (tmp_path / "m.safetensors.fp16.safetensors").write_bytes(b"")  # a stray variant file
    index = {
        "weight_map": {"a": "m-00001-of-00002.safetensors", "b": "m-00002-of-00002.safetensors"}
    }
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(index))
    assert [p.name for p in weight_files_in(tmp_path)] == [
        "m-00001-of-00002.safetensors",
        "m-00002-of-00002.safetensors",
    ]
    index["weight_map"]["c"] = "gone.safetensors"
    (tmp_path / "m.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightFileError, match="missing shards"):
        weight_files_in(tmp_path)


def test_dtype_from_config_and_headers(tmp_path: Path) -> None:
    save_file(
        {"big": torch.zeros(64, dtype=torch.bfloat16), "small": torch.zeros(8)},
        str(tmp_path / "w.safetensors"),
    )
    assert dtype_from_headers([tmp_path / "w.safetensors"]) == "bfloat16"
    assert dtype_from_config(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "float16"}))
    assert dtype_from_config(tmp_path) == "float16"
    assert resolve_dtype("auto", [tmp_path], [tmp_path / "w.safetensors"]) == "float16"
    assert resolve_dtype("auto", [], [tmp_path / "w.safetensors"]) == "bfloat16"
    assert resolve_dtype("float32", [tmp_path], []) == "float32"


@pytest.fixture(scope="module")
def sdxl_style_dir(diffusion_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny pipeline saved in bf16, with fp16 variant files beside it in every folder."""
    from diffusers import DiffusionPipeline

    out = tmp_path_factory.mktemp("models") / "tiny-sd-variants"
    pipe = DiffusionPipeline.from_pretrained(str(diffusion_dir), torch_dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    pipe.save_pretrained(str(out), safe_serialization=True)
    pipe.to(torch.float16)
    pipe.save_pretrained(str(out), safe_serialization=True, variant="fp16")
    assert (out / "unet" / "diffusion_pytorch_model.fp16.safetensors").is_file()
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    return out


@pytest.mark.parametrize(("variant", "dtype"), [(None, torch.bfloat16), ("fp16", torch.float16)])
def test_variant_pipeline_loads_in_saved_dtype_fully_reloadable(
    sdxl_style_dir: Path, variant: str | None, dtype: torch.dtype
) -> None:
    config = WorkerConfig(
        runner="diffusion", backend="diffusers", model=sdxl_style_dir, variant=variant
    )
    runner = DiffusionRunner(config)
    runner.load()
    assert runner.dtype == dtype
    assert runner.pipeline.unet.dtype == dtype
    engine = WeightEngine(runner.modules(), torch.device("cpu"), runner.weight_files())
    # every tensor matches its file: level 2 reloads all of it, keeps nothing on the host
    persistent = sum(
        t.numel() * t.element_size()
        for module in runner.modules().values()
        for t in module.state_dict().values()
    )
    assert engine.file_backed_bytes == persistent
    engine.close()


def test_level2_engine_keeps_no_host_copy_while_awake() -> None:
    model = torch.nn.Linear(64, 64)
    engine = WeightEngine({"m": model}, torch.device("cpu"), host_copy=False)
    engine.activate()
    assert engine.host_bytes() == 0
    assert engine._host_future is None
    engine.sleep(1)  # asked for level 1 anyway: a host copy only while asleep
    assert engine.host_bytes() >= 64 * 64 * 4
    engine.wake()
    assert engine.host_bytes() == 0
    engine.close()


def test_asleep_start_peaks_at_model_plus_one_tensor() -> None:
    """Measured in a fresh process (``tests/worker/asleep_peak.py``): as the last test of a
    37-minute pytest process it once read the whole model's growth, the heap's doing."""
    mib = 1024 * 1024
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(root / "worker_image/src"), str(root / "protos/gen/python"), str(root),
         os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tests.worker.asleep_peak"],
        check=True, capture_output=True, text=True, timeout=300, env=env, cwd=root,
    )  # fmt: skip
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    grew = figures["grew"]
    # the host copy replaces the loaded tensors one by one: at most one 16 MiB tensor doubles
    assert grew < 40 * mib, f"host RAM grew by {grew / mib:.0f} MiB at an asleep start"
    assert figures["host_bytes"] >= figures["model_bytes"] == 128 * mib
    assert figures["woke_whole"]
