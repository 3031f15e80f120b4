"""Pack what ``bench/gpu_e2e.py`` needs on the lent GPU host and nothing else can bring there.

The device tool sends one checkout plus a few carried folders, 64 MiB in all per call, to a
machine that has Python 3.12 and PyTorch but no Kubernetes binaries, no kopf, kr8s or diffusers,
and no network. This builds, from the local cache of ``python -m tests.cluster.build`` and the
package index, a folder (default ``/work/main/.gpubundle``) with:

- ``cluster-bin.tar.<zst|xz>``: kube-apiserver, etcd, kube-scheduler, kubectl (and
  kube-controller-manager with ``--controller-manager``), stripped (``strip`` runs on any that
  still has a symbol table or DWARF; the build links with ``-s -w``, so none has), tarred
  together and compressed once with a window spanning the whole tar: the binaries share most
  of their Go code, so one long-window stream is much smaller than the parts compressed apart.
  ``zstd -17 --long`` by default (``--level``; 20-22 add ``--ultra``); ``--compressor xz``
  uses ``xz -9e`` with a dictionary as large as the tar; ``auto`` tries both, keeps the smaller.
- ``zstd-tool.tar.xz``: this machine's ``zstd`` and the libraries it links, for a host without
  one (Python's standard library reads xz, not zstd).
- ``site.tar.xz``: the cp312 manylinux wheels of the Python packages the host lacks
  (``MISSING_ON_HOST``, one version each, pinned to this venv's versions) installed with
  ``pip install --target`` for the host's platform, then tarred and compressed (xz of the
  installed files is smaller than the wheels' zips); ``wheels/`` keeps the wheels themselves
  with ``--wheels``.
- ``manifest.json``: every file's size and sha256, the compressor and the binaries' names.

Archives are reused when their inputs are unchanged (the build key, names and compressor for
the binaries; the pinned wheel list for the site), since compressing takes minutes. It prints
each part's size and the total with the tree that travels (``--tree``, default this
checkout's tracked files, or the ``--devtree`` copy), and fails when that is over ``--limit``.

Measured on this project's 2-core machine (2026-11-22, under load), the five binaries (360 MB
stripped): ``zstd -19 --long=29`` over 46 MB (unfinished at 13 min); ``xz -9e`` with a 384 MiB
dictionary 5.4x on the first 57 MB, at 7 MB a minute (too slow here). The four without the
controller-manager (265 MB): ``zstd -12 --long=29`` 53.1 MB in 44 s, ``-17`` 49.0 MB in 7 min:
with the 11 MB of packages and the tree that fits 64 MiB; the controller-manager does not.

    python -m bench.gpu_bundle [--out DIR] [--compressor zstd|xz|auto] [--controller-manager]
    python -m bench.gpu_bundle --devtree /work/main/.devtree   # also copy this checkout's
                                                               # tracked files there

``--image-site SITE`` packs instead (``bench/gpu_image_site.py``) the worker image's own Python
environment (``SITE``: its ``site-packages``, read from ``buildah mount``) for
``bench/gpu_e2e.py --image-site`` (default ``--out``: ``/work/main/.gpuimage``): every
distribution the image holds, at the image's version, except the CUDA stack (torch, triton,
``nvidia-*``, ``cuda-toolkit``: gigabytes) and the installers, which the host must have at the
identical version (``gpu_e2e`` checks and reports each). Pure distributions travel as the
image's own files (its ``RECORD``); compiled ones as the cp312 wheel of the same version (the
host runs Python 3.12, the image built here 3.11: Debian bookworm's, standing in for the
Dockerfile's CUDA base, whose Ubuntu 24.04 has 3.12). ``IMAGE_SITE.json`` at the site's root
says which came how; the tar.xz is split into parts of ``--part-mib`` so that it can travel
over several calls.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.cluster.build import cache_root, find_binaries  # noqa: E402

MiB = 1024**2
Json = dict[str, Any]
LIMIT = 64 * MiB
DEFAULT_OUT = Path("/work/main/.gpubundle")
CORE_BINARIES = ("kube-apiserver", "etcd", "kube-scheduler", "kubectl")
CONTROLLER_MANAGER = "kube-controller-manager"
# Packages the GPU host's image lacks (its package list, KINDS.md), with what they need that is
# missing too. Versions are read from this machine's venv so host and CI run the same code.
MISSING_ON_HOST = (
    "kopf",
    "python-json-logger",
    "jsonpatch",
    "jsonpointer",
    "iso8601",
    "kr8s",
    "cachetools",
    "cryptography",
    "cffi",
    "pycparser",
    "httpx-ws",
    "wsproto",
    "python-box",
    "python-jsonpath",
    "diffusers",
    "importlib_metadata",
    "grpcio-health-checking",
    "grpcio-reflection",
    "starlette",  # the worker's OpenAI-compatible HTTP API (every pod gets --http-port)
    "uvicorn",
    "sniffio",  # httpcore's async-library check (pyproject.toml: the operator extra)
)
# the generated stubs need grpcio >= 1.85.1 and protobuf >= 7.35.1 at run time
GRPC = ("grpcio", "protobuf")
# pure-Python wheels exist for these; the index's compiled builds are 100x larger
PURE = ("python-box",)
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


@dataclass(frozen=True)
class Packed:
    """One compressed archive: its path, size and how long it took."""

    path: Path
    size: int
    seconds: float


def has_symbols(path: Path) -> bool:
    """Whether an ELF64 file still has a ``.symtab`` or ``.debug_*`` section."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        return False
    order: Literal["little", "big"] = "little" if data[5] == 1 else "big"

    def num(off: int, size: int) -> int:
        return int.from_bytes(data[off : off + size], order)

    shoff, shentsize, shnum, shstrndx = num(0x28, 8), num(0x3A, 2), num(0x3C, 2), num(0x3E, 2)
    if not shoff or shstrndx >= shnum:
        return False
    strtab = shoff + shstrndx * shentsize
    names_off = num(strtab + 0x18, 8)
    for i in range(shnum):
        name_at = names_off + num(shoff + i * shentsize, 4)
        name = data[name_at : data.index(b"\0", name_at)]
        if name == b".symtab" or name.startswith((b".debug_", b".zdebug_")):
            return True
    return False


def stage_binaries(names: tuple[str, ...], dest: Path) -> dict[str, int]:
    """Copy the built binaries to ``dest``, stripping any that is not stripped yet."""
    source = find_binaries().directory
    sizes = {}
    for name in names:
        target = dest / name
        shutil.copy2(source / name, target)
        if has_symbols(target):
            subprocess.run(["strip", "--strip-all", str(target)], check=True)
        sizes[name] = target.stat().st_size
    return sizes


def make_tar(directory: Path, names: tuple[str, ...], tar_path: Path) -> None:
    """An uncompressed tar of ``names`` (the largest first, so related code sits together)."""
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name in names:
            info = tar.gettarinfo(str(directory / name), arcname=name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with (directory / name).open("rb") as fh:
                tar.addfile(info, fh)


def compress(tar_path: Path, kind: str, level: int) -> Packed:
    """Compress ``tar_path`` with a window spanning the whole tar (zstd or xz)."""
    start = time.monotonic()
    size_mib = tar_path.stat().st_size // MiB + 1
    if kind == "xz":
        out = tar_path.with_name(tar_path.name + ".xz")
        dict_mib = min(1536, max(64, 1 << size_mib.bit_length()))
        preset = "9e" if level >= 19 else "6"
        subprocess.run(
            ["xz", "-T1", "-k", "-f", f"--lzma2=preset={preset},dict={dict_mib}MiB", str(tar_path)],
            check=True,
        )
    elif kind == "zstd":
        out = tar_path.with_name(tar_path.name + ".zst")
        log = min(31, max(27, size_mib.bit_length() + 20))
        flags = ["--ultra", f"-{level}"] if level > 19 else [f"-{level}"]
        subprocess.run(
            ["zstd", "-q", "-f", *flags, f"--long={log}", f"-T{os.cpu_count() or 1}",
             str(tar_path), "-o", str(out)],
            check=True,
        )  # fmt: skip
    else:
        raise ValueError(kind)
    return Packed(out, out.stat().st_size, time.monotonic() - start)


def pins(with_grpc: bool) -> tuple[list[str], list[str]]:
    """``name==version`` of the compiled/any wheels and of the pure ones, from this venv."""
    names = [n for n in MISSING_ON_HOST if n not in PURE] + (list(GRPC) if with_grpc else [])
    return (
        [f"{n}=={importlib.metadata.version(n)}" for n in names],
        [f"{n}=={importlib.metadata.version(n)}" for n in PURE],
    )


def download_wheels(dest: Path, with_grpc: bool) -> list[Path]:
    """cp312 manylinux wheels of the missing packages at this venv's versions (one each)."""
    dest.mkdir(parents=True, exist_ok=True)
    binary, pure = pins(with_grpc)
    common = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
              "--python-version", "3.12", "-d", str(dest)]  # fmt: skip
    platforms = [a for p in PLATFORMS for a in ("--platform", p)]
    subprocess.run([*common, "--implementation", "cp", *platforms, *binary], check=True)
    subprocess.run([*common, "--implementation", "py", "--platform", "any", *pure], check=True)
    wanted = {_norm(x.split("==")[0]) for x in binary + pure}
    for wheel in sorted(dest.glob("*.whl")):  # leftovers of an earlier pin or of --no-grpc
        if _norm(wheel.name.split("-")[0]) not in wanted:
            wheel.unlink()
    wheels = sorted(dest.glob("*.whl"))
    seen: dict[str, Path] = {}
    for wheel in wheels:
        key = _norm(wheel.name.split("-")[0])
        if key in seen:
            raise SystemExit(f"two wheels of {key}: {seen[key].name} and {wheel.name}")
        seen[key] = wheel
    return wheels


def site_archive(wheels: list[Path], out: Path) -> Path:
    """The wheels installed for the host (``pip --target``), as one ``site.tar.xz``."""
    archive = out / "site.tar.xz"
    key = hashlib.sha256("\n".join(w.name for w in wheels).encode()).hexdigest()
    stamp = out / "site.key"
    if archive.exists() and stamp.exists() and stamp.read_text() == key:
        return archive
    with tempfile.TemporaryDirectory(prefix="gpusite-") as tmp:
        site = Path(tmp) / "site"
        platforms = [a for p in PLATFORMS for a in ("--platform", p)]
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--no-compile", "--target", str(site), "--python-version", "3.12",
             "--implementation", "cp", *platforms, "--platform", "any",
             "--only-binary=:all:", *map(str, wheels)],
            check=True,
        )  # fmt: skip
        tar_path = Path(tmp) / "site.tar"
        with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
            tar.add(site, arcname=".")
        packed = compress(tar_path, "xz", level=19)
        shutil.move(packed.path, archive)
    stamp.write_text(key)
    return archive


def zstd_tool(out: Path) -> Path:
    """This machine's ``zstd`` with the shared libraries it links (not libc), as tar.xz."""
    archive = out / "zstd-tool.tar.xz"
    if archive.exists():
        return archive
    exe = Path(shutil.which("zstd") or "/usr/bin/zstd").resolve()
    libs = []
    ldd = subprocess.run(["ldd", str(exe)], capture_output=True, text=True, check=True).stdout
    for line in ldd.splitlines():
        parts = line.split()
        if "=>" in parts and len(parts) > 2 and not parts[0].startswith(("libc.", "ld-linux")):
            libs.append(Path(parts[2]).resolve())
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(exe, arcname="zstd")
        for lib in libs:
            tar.add(lib, arcname=lib.name.split(".so")[0] + ".so." + _soname_version(lib))
    return archive


def _soname_version(lib: Path) -> str:
    """``1`` for ``liblz4.so.1.9.4`` (the name the loader asks for)."""
    return lib.name.split(".so.")[1].split(".")[0] if ".so." in lib.name else "0"


def _norm(name: str) -> str:
    return name.lower().replace("-", "_").replace(".", "_")


def tree_bytes(tree: Path) -> int:
    """Bytes of the tracked files of the checkout at ``tree`` (what the device tool sends)."""
    out = subprocess.run(
        ["git", "-C", str(tree), "ls-files", "-z"], capture_output=True, check=True
    ).stdout
    return sum((tree / f).stat().st_size for f in out.decode().split("\0") if f)


def copy_devtree(source: Path, dest: Path) -> int:
    """Copy the tracked files of ``source`` (as they are on disk) into a fresh ``dest``, with
    ``COMMIT`` naming the commit they came from (``bench/gpu_e2e.py`` reports it)."""
    files = (
        subprocess.run(
            ["git", "-C", str(source), "ls-files", "-z"], capture_output=True, check=True
        )
        .stdout.decode()
        .split("\0")
    )
    shutil.rmtree(dest, ignore_errors=True)
    total = 0
    for name in filter(None, files):
        src = source / name
        if not src.is_file():
            continue  # deleted in the work tree
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
        total += src.stat().st_size
    head = subprocess.run(
        ["git", "-C", str(source), "rev-parse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "-C", str(source), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    (dest / "COMMIT").write_text(f"{head}{' (with uncommitted changes)' if dirty else ''}\n")
    return total


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(MiB), b""):
            h.update(block)
    return h.hexdigest()


def binaries_archive(names: tuple[str, ...], out: Path, kind: str, level: int) -> Json:
    """The compressed tar of the binaries, reused when the build and the choice are unchanged."""
    key = f"{find_binaries().directory.name} {' '.join(names)} {kind} level={level}"
    stamp = out / "cluster-bin.key"
    existing = sorted(out.glob("cluster-bin.tar.*"))
    if stamp.exists() and stamp.read_text() == key and existing:
        data: Json = json.loads((out / "cluster-bin.json").read_text())
        return data
    with tempfile.TemporaryDirectory(prefix="gpubundle-") as tmp:
        stage = Path(tmp)
        raw = stage_binaries(names, stage)
        tar_path = stage / "cluster-bin.tar"
        make_tar(stage, tuple(sorted(names, key=lambda n: -raw[n])), tar_path)
        kinds = ("zstd", "xz") if kind == "auto" else (kind,)
        packed = [compress(tar_path, k, level) for k in kinds]
        for old in existing:
            old.unlink()
        best = min(packed, key=lambda x: x.size)
        archive = out / best.path.name
        shutil.move(best.path, archive)
    info: Json = {
        "archive": archive.name,
        "compressor": archive.suffix.lstrip("."),
        "binary_bytes": raw,
        "tried": {
            x.path.suffix.lstrip("."): {"bytes": x.size, "seconds": round(x.seconds, 1)}
            for x in packed
        },
    }
    (out / "cluster-bin.json").write_text(json.dumps(info, indent=2) + "\n")
    stamp.write_text(key)
    return info


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--compressor", choices=("zstd", "xz", "auto"), default="zstd")
    p.add_argument(
        "--level", type=int, default=17, help="zstd level (20-22: --ultra); xz: 9e at >= 19, else 6"
    )
    p.add_argument("--controller-manager", action="store_true", help="bundle it too")
    p.add_argument("--no-grpc", action="store_true", help="the host's grpcio/protobuf suffice")
    p.add_argument("--wheels", action="store_true", help="carry the wheels, not site.tar.xz")
    p.add_argument("--tree", type=Path, default=ROOT, help="checkout whose files travel too")
    p.add_argument("--devtree", type=Path, help="copy this checkout's tracked files there")
    p.add_argument("--limit", type=int, default=LIMIT)
    p.add_argument("--image-site", type=Path, help="pack this image site-packages instead")
    p.add_argument("--part-mib", type=int, default=60, help="--image-site's part size")
    args = p.parse_args(argv)
    if args.image_site:
        from bench.gpu_image_site import pack_image_site

        parts: Path = DEFAULT_OUT.with_name(".gpuimage") if args.out == DEFAULT_OUT else args.out
        record = pack_image_site(args.image_site, parts, args.part_mib)
        for name, size in record["parts"].items():
            print(f"{parts / name}: {size / MiB:.1f} MiB")
        return 0

    out: Path = args.out
    cache = cache_root() / "gpubundle"
    cache.mkdir(parents=True, exist_ok=True)
    names = CORE_BINARIES + ((CONTROLLER_MANAGER,) if args.controller_manager else ())
    info = binaries_archive(names, cache, args.compressor, args.level)
    wheels = download_wheels(cache / "wheels", with_grpc=not args.no_grpc)
    picked = [cache / info["archive"], zstd_tool(cache)]
    picked += wheels if args.wheels else [site_archive(wheels, cache)]
    shutil.rmtree(out, ignore_errors=True)
    (out / "wheels").mkdir(parents=True)
    carried = []
    for f in picked:  # what travels is exactly this folder
        target = out / f.relative_to(cache)
        shutil.copy2(f, target)
        carried.append(target)
    site = None if args.wheels else "site.tar.xz"
    manifest = {
        **info,
        "binaries": list(names),
        "site": site,
        "wheels": [w.name for w in wheels] if args.wheels else [],
        "files": {
            str(f.relative_to(out)): {"bytes": f.stat().st_size, "sha256": sha256(f)}
            for f in carried
        },
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    if args.devtree:  # the copy travels inside the checkout that holds it
        tree = copy_devtree(args.tree, args.devtree) + tree_bytes(args.devtree.parent)
    else:
        tree = tree_bytes(args.tree)
    payload = sum(f.stat().st_size for f in carried) + (out / "manifest.json").stat().st_size
    raw = info["binary_bytes"]
    print(f"binaries (stripped): {sum(raw.values()) / MiB:.1f} MiB  "
          + ", ".join(f"{n} {b / MiB:.1f}" for n, b in raw.items()))  # fmt: skip
    for kind, t in info["tried"].items():
        print(f"  {kind}: {t['bytes'] / MiB:.1f} MiB in {t['seconds']:.0f}s")
    for f in carried:
        print(f"{f.relative_to(out)}: {f.stat().st_size / MiB:.2f} MiB")
    print(f"bundle {out}: {payload / MiB:.1f} MiB; tree {tree / MiB:.1f} MiB; "
          f"total {(payload + tree) / MiB:.1f} MiB (limit {args.limit / MiB:.0f} MiB)")  # fmt: skip
    if payload + tree > args.limit:
        print("over the limit: leave out more (--no-grpc) or split the call")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
