"""Stage the pinned vLLM on the lent GPU host, which has PyTorch 2.11 but no vLLM and no network.

vLLM's wheel (279 MB) is larger than one device call may carry (64 MiB with the tree), and
importing ``vllm.LLM`` needs some forty packages the host's image lacks. This builds, once,
folders that the device tool carries in consecutive calls (a warm machine keeps ``/tmp``):

- ``.vllm1/kernels.part.aa``: the first part of ``vllm/_C_stable_libtorch.abi3.so`` (xz);
- ``.vllm2/``: the rest of it and the Python part of vLLM (``vllm.tar.xz``);
- ``.vllmdeps/deps.tar.xz``: its missing dependencies, with what vLLM's OpenAI server and the
  worker need (fastapi, uvicorn, grpcio, ...), installed for the host's Python.

``bench/vllm_host_setup.sh`` (tracked, so it travels with the tree) joins them into
``/tmp/vsite``. The wheel is slimmed of what an H100 run of a dense model does not use: the
FlashAttention 2 and 3 libraries (the Triton attention backend runs instead), the MoE kernels
(imported in a ``try``), the Rust tool and the CUTLASS/DeepGEMM headers; FlashInfer is absent
(``VLLM_USE_FLASHINFER_SAMPLER=0``). Seen on the H100 (2026-11-23): a random 8-layer Llama
loads, sleeps at levels 1 and 2 and generates the same token ids after each wake.

    python -m bench.vllm_bundle [--work /work/vllmstage] [--out /work/main]
    # then, on the device, one call after the other:
    #   carry [".vllm1"]: mkdir -p /tmp/vs && cp .vllm1/* /tmp/vs/
    #   carry [".vllmdeps"]: cp .vllmdeps/* /tmp/vs/
    #   carry [".vllm2"]: source bench/vllm_host_setup.sh && python3 bench/vllm_stage.py ...
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gpu_bundle import PLATFORMS, compress  # noqa: E402

VLLM = "vllm==0.24.0"
KERNELS = "vllm/_C_stable_libtorch.abi3.so"
SLIMMED = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/fmha_sm100",
    "vllm/third_party/deep_gemm",
)
# What `from vllm import LLM` and a V1 engine need that the host's image lacks (KINDS.md), at
# versions that import together (xgrammar 0.2.3 is the last for apache-tvm-ffi 0.1.9; openai 3
# needs httpx2).
HOST_DEPS = [
    "annotated_types==0.8.0",
    "apache_tvm_ffi==0.1.9",
    "astor==0.8.1",
    "blake3==1.0.11",
    "cachetools==8.0.1",
    "cbor2==6.3.0",
    "compressed_tensors==0.17.0",
    "depyf==0.20.0",
    "dill==0.4.1",
    "diskcache==5.6.3",
    "distro==1.9.0",
    "fastapi==0.136.3",
    "gguf==0.19.0",
    "ijson==3.6.0",
    "interegular==0.3.3",
    "jiter==0.19.0",
    "jsonschema==4.26.0",
    "jsonschema_specifications==2025.9.1",
    "lark==1.2.2",
    "llguidance==1.7.6",
    "lm_format_enforcer==0.11.3",
    "mistral_common==1.13.1",
    "msgspec==0.22.0",
    "openai==2.54.0",
    "openai_harmony==0.0.8",
    "outlines_core==0.2.14",
    "partial_json_parser==0.2.1.1.post7",
    "prometheus_fastapi_instrumentator==8.1.0",
    "pybase64==1.5.1",
    "pydantic==2.14.3",
    "pydantic_core==2.50.4",
    "python_json_logger==4.2.0",
    "pyzmq==27.3.0",
    "referencing==0.37.0",
    "rpds_py==2026.9.1",
    "setproctitle==1.3.8",
    "sniffio==1.3.1",
    "starlette==1.10.0",
    "typing_extensions==4.16.0",
    "typing_inspection==0.4.5",
    "watchfiles==1.3.0",
    "xgrammar==0.2.3",
    # vLLM's OpenAI server in the worker (vllm.entrypoints.openai.api_server's routers) and the
    # worker itself (gRPC stubs need grpcio >= 1.85.1, protobuf >= 7.35.1; its HTTP server)
    "model_hosting_container_standards==0.1.16",
    "jmespath==1.0.1",
    "uvicorn==0.54.0",
    "grpcio==1.85.1",
    "grpcio_health_checking==1.85.1",
    "grpcio_reflection==1.85.1",
    "protobuf==7.36.2",
]
# a static library the bindings do not load at run time (65 MB)
DEPS_DROPPED = ("xgrammar/lib",)
PART = 60_000_000
# glibc tags the host (glibc 2.39) also takes: llguidance 1.7.6 is manylinux_2_31 only
EXTRA_PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64")


def download(what: list[str], dest: Path) -> None:
    """cp312 manylinux wheels (``--no-deps``: every need is named)."""
    platforms = [a for p in (*PLATFORMS, *EXTRA_PLATFORMS) for a in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         "--python-version", "3.12", "--implementation", "cp", *platforms, "--platform", "any",
         "-d", str(dest), *what],
        check=True,
    )  # fmt: skip


def tar_xz(root: Path, names: list[str], out: Path, level: int = 19) -> Path:
    """``names`` under ``root`` as one xz-compressed tar at ``out``."""
    tar_path = out.with_suffix("")  # x.tar.xz -> x.tar
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            tar.add(root / name, arcname=name)
    packed = compress(tar_path, "xz", level=level)
    tar_path.unlink()
    shutil.move(packed.path, out)
    return out


def split(path: Path, dests: list[Path]) -> None:
    """Cut ``path`` into parts of at most ``PART`` bytes, the n-th into ``dests[n]``."""
    data = path.read_bytes()
    parts = [data[i : i + PART] for i in range(0, len(data), PART)]
    if len(parts) > len(dests):
        raise SystemExit(f"{path.name}: {len(parts)} parts but {len(dests)} folders")
    for n, part in enumerate(parts):
        dests[n].mkdir(parents=True, exist_ok=True)
        (dests[n] / f"kernels.part.a{chr(ord('a') + n)}").write_bytes(part)


def build(work: Path, out: Path) -> None:
    """Download, slim, pack and split into ``out/.vllm1`` and ``out/.vllm2``."""
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download([VLLM], wheels)
    wheel = next(wheels.glob("vllm-*.whl"))
    tree = work / "vllm-tree"
    shutil.rmtree(tree, ignore_errors=True)
    with zipfile.ZipFile(wheel) as zf:
        zf.extractall(tree)
    for name in SLIMMED:
        target = tree / name
        shutil.rmtree(target) if target.is_dir() else target.unlink(missing_ok=True)
    kernels = work / "kernels.tar.xz"
    if not kernels.exists() or kernels.stat().st_mtime < wheel.stat().st_mtime:
        kernels = tar_xz(tree, [KERNELS], kernels)  # minutes: reused when the wheel is the same
    (tree / KERNELS).unlink()
    python_part = tar_xz(tree, sorted(p.name for p in tree.iterdir()), work / "vllm.tar.xz")
    deps = work / "deps"
    shutil.rmtree(deps, ignore_errors=True)
    download(HOST_DEPS, deps)
    site = work / "deps-site"
    shutil.rmtree(site, ignore_errors=True)
    platforms = [a for p in (*PLATFORMS, *EXTRA_PLATFORMS) for a in ("--platform", p)]
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
         "--target", str(site), "--python-version", "3.12", "--implementation", "cp",
         *platforms, "--platform", "any", "--only-binary=:all:",
         *map(str, sorted(deps.glob("*.whl")))],
        check=True,
    )  # fmt: skip
    for name in DEPS_DROPPED:
        shutil.rmtree(site / name, ignore_errors=True)
    deps_part = tar_xz(site, sorted(p.name for p in site.iterdir()), work / "deps.tar.xz", 6)
    first, second, third = out / ".vllm1", out / ".vllm2", out / ".vllmdeps"
    for folder in (first, second, third):
        shutil.rmtree(folder, ignore_errors=True)
    split(kernels, [first, second])
    shutil.copy2(python_part, second / "vllm.tar.xz")
    third.mkdir(parents=True)
    shutil.copy2(deps_part, third / "deps.tar.xz")
    for folder in (first, second, third):
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{folder}: {size / 2**20:.1f} MiB")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/work/vllmstage"))
    parser.add_argument("--out", type=Path, default=ROOT)
    args = parser.parse_args(argv)
    build(args.work, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
