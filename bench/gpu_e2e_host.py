"""The GPU host as ``bench/gpu_e2e.py`` (and the benches that share its set-up) finds it: the
bundle's binaries and packages unpacked and put on PATH and PYTHONPATH, the versions of what
runs, the worker image's environment checked, and the devices NVML shows."""

from __future__ import annotations

import importlib
import json
import lzma
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC_PATHS = [
    ROOT / "operator" / "src",
    ROOT / "worker_image" / "src",
    ROOT / "protos" / "gen" / "python",
    ROOT,
]
Json = dict[str, Any]


def unpack_bundle(bundle: Path, work: Path, image_site: Path | None = None) -> Json:
    """Binaries into ``work/bin``, packages into ``work/site``; PATH and PYTHONPATH set
    (``image_site`` first, when given)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    bindir, site, shims = work / "bin", work / "site", work / "shims"
    out: Json = {"compressor": manifest["compressor"], "binaries": manifest["binaries"]}
    start = time.monotonic()
    bindir.mkdir(parents=True, exist_ok=True)
    archive = bundle / manifest["archive"]
    if not all((bindir / n).is_file() for n in manifest["binaries"]):
        if archive.suffix == ".xz":
            extract_xz(archive, bindir)
        else:
            zstd, env = zstd_command(bundle, work)
            out["zstd"] = zstd
            proc = subprocess.Popen(
                [zstd, "-dc", "--long=31", str(archive)], stdout=subprocess.PIPE, env=env
            )
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                tar.extractall(bindir, filter="data")
            if proc.wait() != 0:
                raise RuntimeError(f"zstd failed on {archive}")
    out["unpack_seconds"] = round(time.monotonic() - start, 2)
    start = time.monotonic()
    if not (site / ".installed").is_file():
        if manifest.get("site"):
            extract_xz(bundle / manifest["site"], site)
        else:
            wheels = [str(bundle / "wheels" / w) for w in manifest["wheels"]]
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                 "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *wheels],
                check=True,
            )  # fmt: skip
        (site / ".installed").write_text("")
    out["install_seconds"] = round(time.monotonic() - start, 2)
    shims.mkdir(parents=True, exist_ok=True)
    for name, module in (("omnistage-worker", "omnistage_worker.cli"),
                         ("omnistage-operator", "omnistage_operator.cli")):  # fmt: skip
        script = shims / name
        script.write_text(
            f"#!{sys.executable}\nimport sys\nfrom {module} import main\nsys.exit(main())\n"
        )
        script.chmod(0o755)
    paths = [*([str(image_site)] if image_site else []), str(site), *(str(p) for p in SRC_PATHS)]
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ["PATH"] = os.pathsep.join([str(shims), str(bindir), os.environ.get("PATH", "")])
    return out


def extract_xz(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with lzma.open(archive) as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
        tar.extractall(dest, filter="data")


def zstd_command(bundle: Path, work: Path) -> tuple[str, dict[str, str] | None]:
    """The host's ``zstd``, else the bundle's (with its libraries on LD_LIBRARY_PATH)."""
    import shutil

    found = shutil.which("zstd")
    if found:
        return found, None
    tool = work / "zstd-tool"
    extract_xz(bundle / "zstd-tool.tar.xz", tool)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(tool), env.get("LD_LIBRARY_PATH")]))
    return str(tool / "zstd"), env


def versions() -> Json:
    import importlib.metadata as md

    names = ("torch", "transformers", "diffusers", "kopf", "kr8s", "grpcio", "protobuf",
             "nvidia-ml-py", "aiohttp", "click", "httpx")  # fmt: skip
    out: Json = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


def image_env(image_site: Path) -> Json:
    """Where each of the image's distributions comes from here, checked: the carried ones
    must resolve to ``image_site``, the host's must be at the image's version."""
    import importlib.metadata as md

    record = json.loads((image_site / "IMAGE_SITE.json").read_text())
    host: Json = {}
    carried: Json = {}
    problems = []
    for name, d in record["dists"].items():
        try:
            dist = md.distribution(name)
            version, where = dist.version, Path(str(dist.locate_file(""))).resolve()
        except md.PackageNotFoundError:
            version, where = None, None
        if d["from"] == "host":
            host[name] = {"image": d["version"], "host": version}
            if name in ("pip", "setuptools"):  # the venv's installers: nothing here imports them
                host[name]["compared"] = False
                continue
            if name == "torch":  # the index's wheel says 2.11.0, the CUDA index's 2.11.0+cu130
                same = _torch_git(record.get("torch_version_py", "")) == _torch_git(None)
            else:
                same = version == d["version"]
            if not same:
                problems.append(f"{name}: image {d['version']}, host {version}")
        else:
            carried[name] = d["version"]
            if version != d["version"] or where != image_site.resolve():
                problems.append(f"{name} {d['version']}: resolves to {version} at {where}")
    import torch

    return {
        "image_site": str(image_site),
        "carried_from_image": carried,
        "carried_as": {
            k: sum(1 for d in record["dists"].values() if d["from"] == k)
            for k in ("image files", "cp312 wheel")
        },
        "cp312_wheels": record.get("wheels", []),
        "from_host": host,
        "host_torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "git_version": torch.version.git_version,
        },
        "image_torch_version_py": record.get("torch_version_py"),
        "python": platform.python_version(),
        "problems": problems,
        "all_identical": not problems,
    }


def _torch_git(version_py: str | None) -> str | None:
    """The git commit torch was built from: of a ``torch/version.py`` text, or of this torch."""
    if version_py is None:
        import torch

        return str(torch.version.git_version)
    found = re.search(r"^git_version = '([0-9a-f]+)'", version_py, re.MULTILINE)
    return found.group(1) if found else None


def nvml_devices() -> list[Json]:
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out.append({
            "index": i,
            "name": _s(pynvml.nvmlDeviceGetName(h)),
            "uuid": _s(pynvml.nvmlDeviceGetUUID(h)),
            "total_bytes": int(mem.total),
            "free_bytes": int(mem.free),
            "driver": _s(pynvml.nvmlSystemGetDriverVersion()),
        })  # fmt: skip
    return out


def _s(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v
