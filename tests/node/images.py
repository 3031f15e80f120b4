"""Build omnistage's images here, with no Docker daemon and no image registry (buildah).

``python -m tests.node.images`` (``make images``):

1. the **base image**: a minimal Debian rootfs (``debootstrap --variant=minbase`` from the
   machine's own Debian mirror, with python3, python3-venv and a venv holding pip on PATH, as
   the official ``python:*-slim`` images have, and this machine's local CAs) imported by buildah as
   ``localhost/omnistage-base:<suite>``; it stands in for both bases the Dockerfiles take as
   build arguments (``PYTHON_IMAGE``, ``CUDA_IMAGE``: users keep the CUDA one);
2. the **pause** image every pod sandbox of the real node runs (the usual one cannot be
   pulled): ``tests/node/pause`` built as a static Go binary, alone in a scratch image;
3. the **operator** and **worker** images from ``operator/Dockerfile`` and
   ``worker_image/Dockerfile`` with ``buildah bud`` (the Dockerfiles' own steps), each also
   written as an OCI archive a container runtime imports without a registry
   (``ctr -n k8s.io images import``); the build time and size of each are printed and recorded;
4. on request only (``python -m tests.node.images vllm``, ``make images-vllm``): the worker
   image's **vLLM flavour**, ``worker_image/Dockerfile``'s ``vllm`` target, tagged
   ``<version>-vllm`` (vLLM and its own dependency pins: several GB more, so ``make images``
   leaves it out).

Everything is cached under ``$OMNISTAGE_CACHE`` (``~/.cache/omnistage``): ``containers/`` is
buildah's image store (its layer cache makes an unchanged rebuild take seconds),
``images/`` the rootfs tarball, the OCI archives and ``images.json`` (the build records), and
``buildah-tmp/`` the pip cache mount the worker image's install uses (so a rebuild does not
download torch again). Needs root and the Debian packages buildah, debootstrap, fuse-overlayfs.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tests.cluster.build import cache_root

REPO_ROOT = Path(__file__).resolve().parents[2]
SUITE = "bookworm"
BASE_PACKAGES = ("python3", "python3-venv", "python3-pip", "ca-certificates")
BASE_IMAGE = f"localhost/omnistage-base:{SUITE}"
# The venv the base puts first on PATH: `pip`/`python3` as the python:*-slim images give them.
BASE_VENV = "/opt/python"
VERSION = "0.1.0"
LOCAL_CAS = Path("/usr/local/share/ca-certificates")
SYSTEM_CA_BUNDLE = "/etc/ssl/certs/ca-certificates.crt"


@dataclass(frozen=True)
class ImageSpec:
    """One image `make images` builds: its Dockerfile, target and local name.

    ``layers``: reuse buildah's layer cache. buildah keys a RUN's cache on its text and parent
    layer, not on what it bind-mounts from another stage (``--mount=type=bind,from=build``),
    so a cached install would keep stale sources, and a cached build stage cannot be mounted
    at all; the operator (about a minute) is built afresh each time."""

    name: str
    dockerfile: str
    target: str | None
    layers: bool = True
    # appended to the version in the tag: a flavour of an image (``-vllm``)
    flavour: str = ""

    @property
    def tag(self) -> str:
        """The image's tag: the version, then its flavour."""
        return f"{VERSION}{self.flavour}"

    @property
    def ref(self) -> str:
        """The local reference (``localhost/`` never resolves to a registry)."""
        return f"localhost/{self.name}:{self.tag}"

    @property
    def key(self) -> str:
        """The image's entry in ``images.json``: its name and flavour."""
        return f"{self.name}{self.flavour}"


PAUSE = ImageSpec("omnistage-pause", "tests/node/pause", None)
IMAGES: dict[str, ImageSpec] = {
    "operator": ImageSpec("omnistage-operator", "operator/Dockerfile", None, layers=False),
    "worker": ImageSpec("omnistage-worker", "worker_image/Dockerfile", "worker"),
}
# Built only when named: not part of `make images` (nor of what the node tests import).
FLAVOURS: dict[str, ImageSpec] = {
    "vllm": ImageSpec("omnistage-worker", "worker_image/Dockerfile", "vllm", flavour="-vllm"),
}


@dataclass(frozen=True)
class BuildRecord:
    """How one image build went: seconds building, seconds writing its OCI archive, size, date."""

    image: str
    ref: str
    seconds: float
    archive_seconds: float
    size_bytes: int
    archive: str
    date: str


class ImageError(RuntimeError):
    """An image could not be built."""


# --- pure logic ------------------------------------------------------------------------------


def debian_mirror(sources: str) -> str | None:
    """The first Debian archive URI in apt sources text (deb822 ``URIs:`` or one-line ``deb``).

    Security and update archives are skipped: debootstrap needs the main archive.
    """
    uris: list[str] = re.findall(r"^\s*URIs:\s*(\S+)", sources, re.MULTILINE)
    uris += re.findall(r"^\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)\s+\S+", sources, re.MULTILINE)
    for uri in uris:
        if uri.rstrip("/").endswith("/debian"):
            return uri
    return None


def parse_size(text: str) -> int:
    """Bytes of a buildah/podman size string (``"1.23 GB"``, ``"456 MB"``, ``"12.3 kB"``)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*([kKMGT]?B)\s*", text)
    if m is None:
        raise ValueError(f"not a size: {text!r}")
    scale = {"B": 1, "kB": 1000, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}
    return int(float(m.group(1)) * scale[m.group(2)])


BASE_ARGS = ("PYTHON_IMAGE", "CUDA_IMAGE")


def declared_args(dockerfile: str) -> set[str]:
    """Names of the ``ARG`` instructions of a Dockerfile's text."""
    return set(re.findall(r"^\s*ARG\s+([A-Za-z_]\w*)", dockerfile, re.MULTILINE))


def bud_command(spec: ImageSpec, base: str, store: list[str], declared: set[str]) -> list[str]:
    """The ``buildah bud`` command building ``spec`` with ``base`` as each base it declares."""
    cache = ["--layers"] if spec.layers else ["--layers=false", "--no-cache"]
    cmd = ["buildah", *store, "bud", *cache, "--network", "host", "--format", "oci"]
    for arg in BASE_ARGS:
        if arg in declared:
            cmd += ["--build-arg", f"{arg}={base}"]
    if spec.target:
        cmd += ["--target", spec.target]
    return [*cmd, "-f", spec.dockerfile, "-t", spec.ref, "."]


# --- I/O -------------------------------------------------------------------------------------


def images_dir() -> Path:
    """Where the rootfs tarball, OCI archives and build records live."""
    return cache_root() / "images"


def store_flags() -> list[str]:
    """buildah's global flags putting its image store under the cache root (another cache
    root on the same machine gets its own run directory: stores never share one)."""
    root = cache_root()
    runroot = "/run/omnistage-containers"
    if root != Path.home() / ".cache" / "omnistage":
        runroot += "-" + hashlib.sha256(str(root).encode()).hexdigest()[:8]
    return ["--root", str(root / "containers" / "storage"), "--runroot", runroot]


def buildah_env() -> dict[str, str]:
    """buildah's environment: its temporary files and cache mounts under the cache root."""
    tmp = cache_root() / "buildah-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp), "BUILDAH_ISOLATION": "chroot"}


def _run(cmd: list[str], capture: bool = False, cwd: Path = REPO_ROOT) -> str:
    if not capture:
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    # buildah's TMPDIR (under the cache root) does not exist inside a chroot
    env = buildah_env() if cmd[0] == "buildah" else dict(os.environ)
    proc = subprocess.run(cmd, cwd=cwd, env=env, text=True, capture_output=capture, check=False)
    if proc.returncode != 0:
        detail = f"\n{proc.stderr}" if capture else ""
        raise ImageError(f"command failed ({proc.returncode}): {' '.join(cmd)}{detail}")
    return proc.stdout if capture else ""


def _require(*tools: str) -> None:
    missing = [t for t in tools if shutil.which(t) is None]
    if missing:
        raise ImageError(
            f"missing {', '.join(missing)}: apt-get install buildah debootstrap fuse-overlayfs"
        )
    if os.geteuid() != 0:
        raise ImageError("building images here needs root (debootstrap, buildah's chroot)")


def image_exists(ref: str) -> bool:
    """Whether buildah's store holds ``ref``."""
    proc = subprocess.run(
        ["buildah", *store_flags(), "inspect", "--type", "image", ref],
        env=buildah_env(),
        capture_output=True,
        check=False,
    )
    return proc.returncode == 0


def image_size(ref: str) -> int:
    """The image's size as buildah reports it (bytes, uncompressed layers)."""
    rows = json.loads(_run(["buildah", *store_flags(), "images", "--json", ref], capture=True))
    return parse_size(rows[0]["size"]) if isinstance(rows[0]["size"], str) else rows[0]["size"]


def _sources_text() -> str:
    texts = []
    for path in [Path("/etc/apt/sources.list"), *Path("/etc/apt/sources.list.d").glob("*")]:
        if path.is_file() and path.suffix in (".list", ".sources", ""):
            texts.append(path.read_text(errors="replace"))
    return "\n".join(texts)


def _trust_local_cas(rootfs: Path) -> None:
    """Give the rootfs this machine's local CAs (a TLS-inspecting proxy's, say)."""
    local = sorted(LOCAL_CAS.glob("*.crt"))
    if not local:
        return
    target = rootfs / LOCAL_CAS.relative_to("/")
    target.mkdir(parents=True, exist_ok=True)
    for cert in local:
        shutil.copy2(cert, target / cert.name)
    _run(["chroot", str(rootfs), "update-ca-certificates"])


def build_base(force: bool = False) -> str:
    """Build (or reuse) the Debian base image; its reference."""
    if image_exists(BASE_IMAGE) and not force:
        return BASE_IMAGE
    mirror = debian_mirror(_sources_text())
    if mirror is None:
        raise ImageError("no Debian archive in /etc/apt/sources*: debootstrap needs one")
    out = images_dir()
    out.mkdir(parents=True, exist_ok=True)
    tarball = out / f"debian-{SUITE}-python3.tar"
    started = time.monotonic()
    if not tarball.is_file() or force:
        rootfs = out / f"rootfs-{SUITE}.tmp"
        shutil.rmtree(rootfs, ignore_errors=True)
        include = ",".join(BASE_PACKAGES)
        _run(
            ["debootstrap", "--variant=minbase", f"--include={include}", SUITE, str(rootfs), mirror]
        )
        _run(["chroot", str(rootfs), "python3", "-m", "venv", BASE_VENV])
        _trust_local_cas(rootfs)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "var/log"):
            for entry in (rootfs / junk).glob("*"):
                if entry.is_file():
                    entry.unlink()
        partial = tarball.with_suffix(".partial")
        _run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(partial), "."])
        partial.rename(tarball)
        shutil.rmtree(rootfs)
    store = store_flags()
    ctr = _run(["buildah", *store, "from", "scratch"], capture=True).strip()
    try:
        _run(["buildah", *store, "add", ctr, str(tarball), "/"])
        path = f"{BASE_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
        label = f"org.opencontainers.image.base.name=debian:{SUITE}"
        # pip's bundled CA list lacks the local CAs: it uses the system's bundle, as apt does
        env = ["--env", f"PATH={path}", "--env", "LANG=C.UTF-8"]
        env += ["--env", f"PIP_CERT={SYSTEM_CA_BUNDLE}"]
        _run(["buildah", *store, "config", *env, "--cmd", "python3", "--label", label, ctr])
        _run(["buildah", *store, "commit", "--rm", ctr, BASE_IMAGE])
    except ImageError:
        subprocess.run(["buildah", *store, "rm", ctr], env=buildah_env(), check=False)
        raise
    print(f"base image {BASE_IMAGE}: {time.monotonic() - started:.0f}s", flush=True)
    return BASE_IMAGE


def build_pause() -> BuildRecord:
    """The pause binary (Go, static) alone in a scratch image, with its OCI archive."""
    started = time.monotonic()
    from tests.cluster.build import go_binary, go_env

    out = images_dir() / "pause"
    out.mkdir(parents=True, exist_ok=True)
    source = REPO_ROOT / PAUSE.dockerfile
    cmd = [go_binary(), "build", "-trimpath", "-ldflags", "-s -w", "-o", str(out / "pause"), "."]
    if subprocess.run(cmd, cwd=source, env=go_env(), check=False).returncode != 0:
        raise ImageError(f"go build of {source} failed")
    store = store_flags()
    ctr = _run(["buildah", *store, "from", "scratch"], capture=True).strip()
    try:
        _run(["buildah", *store, "copy", "--chmod", "0755", ctr, str(out / "pause"), "/pause"])
        _run(
            [
                "buildah",
                *store,
                "config",
                "--entrypoint",
                '["/pause"]',
                "--user",
                "65535:65535",
                ctr,
            ]
        )
        _run(["buildah", *store, "commit", "--rm", ctr, PAUSE.ref])
    except ImageError:
        subprocess.run(["buildah", *store, "rm", ctr], env=buildah_env(), check=False)
        raise
    return _record(PAUSE, time.monotonic() - started)


def build_image(spec: ImageSpec, base: str) -> BuildRecord:
    """Build ``spec`` with buildah and write its OCI archive; the record (also printed)."""
    started = time.monotonic()
    declared = declared_args((REPO_ROOT / spec.dockerfile).read_text())
    _run(bud_command(spec, base, store_flags(), declared))
    return _record(spec, time.monotonic() - started)


def archive_path(spec: ImageSpec) -> Path:
    """The OCI archive ``make images`` writes for ``spec`` (``ctr images import`` reads it)."""
    return images_dir() / f"{spec.name}-{spec.tag}.oci.tar"


def _record(spec: ImageSpec, seconds: float) -> BuildRecord:
    """Write ``spec``'s OCI archive (timed apart from the build); its build record (printed)."""
    archive = archive_path(spec)
    archive.unlink(missing_ok=True)
    started = time.monotonic()
    _run(["buildah", *store_flags(), "push", spec.ref, f"oci-archive:{archive}:{spec.ref}"])
    record = BuildRecord(
        image=spec.key,
        ref=spec.ref,
        seconds=round(seconds, 1),
        archive_seconds=round(time.monotonic() - started, 1),
        size_bytes=image_size(spec.ref),
        archive=str(archive),
        date=dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    )
    print(
        f"{spec.ref}: built in {record.seconds:.0f}s, {record.size_bytes / 1e6:.0f} MB; "
        f"archive {archive} written in {record.archive_seconds:.0f}s",
        flush=True,
    )
    return record


def save_records(records: list[BuildRecord]) -> Path:
    """Merge ``records`` into ``images.json`` (one entry per image, the latest build)."""
    path = images_dir() / "images.json"
    data: dict[str, object] = json.loads(path.read_text()) if path.is_file() else {}
    for record in records:
        data[record.image] = {**asdict(record), "cpus": os.cpu_count()}
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.node.images", description=__doc__)
    choices = {**IMAGES, **FLAVOURS}
    parser.add_argument(
        "images",
        nargs="*",
        help=f"some of pause, {', '.join(choices)} (default: pause, {', '.join(IMAGES)})",
    )
    parser.add_argument("--base-only", action="store_true", help="only the base image")
    parser.add_argument("--rebuild-base", action="store_true", help="debootstrap afresh")
    args = parser.parse_args(argv)
    try:
        _require("buildah", "debootstrap")
        base = build_base(force=args.rebuild_base)
        if args.base_only:
            return 0
        names = args.images or ["pause", *IMAGES]
        unknown = [n for n in names if n not in choices and n != "pause"]
        if unknown:
            raise ImageError(
                f"unknown image {', '.join(unknown)}: choose from pause, {', '.join(choices)}"
            )
        records = [
            build_pause() if name == "pause" else build_image(choices[name], base) for name in names
        ]
        print(f"records: {save_records(records)}")
        return 0
    except ImageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
