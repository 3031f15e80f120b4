"""``python -m bench.gpu_bundle --image-site SITE``: the worker image's own Python environment
packed for ``bench/gpu_e2e.py --image-site``.

Every distribution the image holds, at the image's version, except the host's CUDA stack and
the installers (:func:`host_side`): pure distributions as the image's own files (its
``RECORD``), compiled ones as the cp312 wheel of the same version; one tar, xz-compressed and
split into parts, with ``IMAGE_SITE.json`` (inside) and ``image-site.json`` (beside) saying
which came how.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from bench.gpu_bundle import PLATFORMS, compress

Json = dict[str, Any]


# The host's CUDA stack (and installers), never carried: the host must have the same versions.
# cuda-bindings and cuda-pathfinder (torch's, though only its testing and inductor's CuTeDSL
# kernels import them) travel: the H200 host has older ones (13.3.1, 1.8.1; 2026-11-26).
HOST_SIDE_NAMES = ("torch", "triton", "cuda-toolkit", "pip", "setuptools")
HOST_SIDE_PREFIXES = ("nvidia-",)
CARRIED_ANYWAY = ("nvidia-ml-py",)  # NVML's Python binding: pure, small, the worker's own


def read_dists(site: Path) -> list[Json]:
    """Each distribution in ``site``: name, version, whether pure, its files (from RECORD)."""
    import email

    dists = []
    for info in sorted(site.glob("*.dist-info")):
        meta = email.message_from_string((info / "METADATA").read_text(errors="replace"))
        wheel = (info / "WHEEL").read_text() if (info / "WHEEL").is_file() else ""
        files = [line.split(",")[0] for line in (info / "RECORD").read_text().splitlines()]
        dists.append(
            {
                "name": meta["Name"],
                "version": meta["Version"],
                "pure": "Root-Is-Purelib: true" in wheel,
                "files": [f for f in files if f and not f.startswith("..")],
            }
        )
    return dists


def host_side(name: str) -> bool:
    """Whether ``name`` is left to the host (its CUDA stack and installers)."""
    n = name.lower()
    if n in CARRIED_ANYWAY:
        return False
    return n in HOST_SIDE_NAMES or n.startswith(HOST_SIDE_PREFIXES)


def pack_image_site(site: Path, out: Path, part_mib: int) -> Json:
    """The image's distributions but the host side, installed into one folder for cp312,
    tarred, xz-compressed and split into parts in ``out``; the provenance record."""
    record: Json = {"image_site": str(site), "dists": {}}
    with tempfile.TemporaryDirectory(prefix="gpuimage-") as tmp:
        stage, wheels = Path(tmp) / "site", Path(tmp) / "wheels"
        stage.mkdir()
        compiled = []
        for d in read_dists(site):
            if host_side(d["name"]):
                record["dists"][d["name"]] = {"version": d["version"], "from": "host"}
            elif d["pure"]:
                for f in d["files"]:
                    if "__pycache__" in f or not (site / f).is_file():
                        continue
                    (stage / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(site / f, stage / f)
                record["dists"][d["name"]] = {"version": d["version"], "from": "image files"}
            else:
                compiled.append(f"{d['name']}=={d['version']}")
                record["dists"][d["name"]] = {"version": d["version"], "from": "cp312 wheel"}
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "--python-version", "3.12", "--implementation", "cp", *platforms,
             "-d", str(wheels), *compiled],
            check=True,
        )  # fmt: skip
        # Into an empty folder, then merged: ``pip --target`` skips a top-level folder that is
        # already there, so a namespace package shared with a pure distribution (``cuda/``:
        # cuda-pathfinder's files, cuda-bindings' wheel) would lose the wheel's half.
        installed = Path(tmp) / "compiled"
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--target", str(installed), "--python-version", "3.12",
             "--implementation", "cp", *platforms, "--only-binary=:all:",
             *map(str, sorted(wheels.glob("*.whl")))],
            check=True,
        )  # fmt: skip
        shutil.copytree(installed, stage, dirs_exist_ok=True)
        record["wheels"] = sorted(w.name for w in wheels.glob("*.whl"))
        if (site / "torch" / "version.py").is_file():  # the host's torch is compared with it
            record["torch_version_py"] = (site / "torch" / "version.py").read_text()
        (stage / "IMAGE_SITE.json").write_text(json.dumps(record, indent=2) + "\n")
        tar_path = Path(tmp) / "image-site.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(stage, arcname=".")
        packed = compress(tar_path, "xz", level=6)
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        prefix = str(out / "image-site.tar.xz.")
        subprocess.run(["split", "-b", f"{part_mib}M", "-d", str(packed.path), prefix], check=True)
    record["parts"] = {p.name: p.stat().st_size for p in sorted(out.iterdir())}
    (out / "image-site.json").write_text(json.dumps(record, indent=2) + "\n")
    return record
