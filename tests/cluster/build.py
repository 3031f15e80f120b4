"""Build (or reuse) the control-plane binaries from the Go module proxy, cached by version.

``python -m tests.cluster.build`` builds kube-apiserver, kube-scheduler,
kube-controller-manager, kubectl (Kubernetes ``K8S_VERSION``) and the etcd server at the version
that release pins in ONE ``go build`` of the wrapper module ``tests/cluster/k8sbuild`` (so shared
packages compile once, with exactly the release's dependency versions), then helm from its own
wrapper module ``tests/cluster/helmbuild`` (helm's own dependency versions: kept apart so helm's
newer grpc/otel/x/* cannot change the Kubernetes binaries). It is idempotent: a second run finds
the binaries and returns.

Everything lives under ``${OMNISTAGE_CACHE:-~/.cache/omnistage}``: ``go/mod`` (GOMODCACHE),
``go/build`` (GOCACHE) and ``cluster-bin/<key>/`` (the binaries and ``build.json``, the build's
own record of how long it took). The key names the versions and a hash of go.mod, go.sum and the
link flags, so a change to any of them builds afresh.

``python -m tests.cluster.build --node`` builds the node binaries the same way, apart: the
kubelet and kube-proxy of the same release from ``tests/cluster/kubeletbuild`` (the same
replaces and dependency versions as ``k8sbuild``), cached in ``node-bin/<key>/`` under its own
key, so the control-plane binaries' key (and cache) does not change with them.

Other commands:
  ``--print-bin NAME``  print one binary's path (fails if not built; ``kubelet`` and
                        ``kube-proxy`` too)
  ``--regen``           regenerate go.mod/go.sum/tools.go from the release's go.mod (network)

Python API: ``ensure_binaries() -> Binaries`` builds if needed; ``find_binaries()`` never builds.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.cluster.gomod import (
    parse_release_gomod,
    render_plain_gomod,
    render_tools_go,
    render_wrapper_gomod,
    requirements,
)

K8S_VERSION = "v1.36.3"
ETCD_VERSION = "v3.6.8"
HELM_MODULE = "helm.sh/helm/v3"
HELM_VERSION = "v3.21.4"
HERE = Path(__file__).resolve().parent
MODULE_DIR = HERE / "k8sbuild"
HELM_MODULE_DIR = HERE / "helmbuild"
KUBELET_MODULE_DIR = HERE / "kubeletbuild"

# binary name -> Go package, per wrapper module (one `go build` each)
K8S_PACKAGES: dict[str, str] = {
    "kube-apiserver": "k8s.io/kubernetes/cmd/kube-apiserver",
    "kube-scheduler": "k8s.io/kubernetes/cmd/kube-scheduler",
    "kube-controller-manager": "k8s.io/kubernetes/cmd/kube-controller-manager",
    "kubectl": "k8s.io/kubernetes/cmd/kubectl",
    "etcd": "go.etcd.io/etcd/server/v3",
}
HELM_PACKAGES: dict[str, str] = {"helm": f"{HELM_MODULE}/cmd/helm"}
PACKAGES: dict[str, str] = {**K8S_PACKAGES, **HELM_PACKAGES}
BUILDS: tuple[tuple[Path, dict[str, str]], ...] = (
    (MODULE_DIR, K8S_PACKAGES),
    (HELM_MODULE_DIR, HELM_PACKAGES),
)
NODE_PACKAGES: dict[str, str] = {
    "kubelet": "k8s.io/kubernetes/cmd/kubelet",
    "kube-proxy": "k8s.io/kubernetes/cmd/kube-proxy",
}
NODE_BUILDS: tuple[tuple[Path, dict[str, str]], ...] = ((KUBELET_MODULE_DIR, NODE_PACKAGES),)
# the file name `go build -o DIR` gives each package's binary
_GO_OUTPUT_NAME = {"etcd": "server"}


class BuildError(RuntimeError):
    """The binaries could not be built or are not built."""


@dataclass(frozen=True)
class Binaries:
    """Paths of the built binaries."""

    apiserver: Path
    scheduler: Path
    controller_manager: Path
    kubectl: Path
    etcd: Path
    helm: Path
    directory: Path

    def by_name(self, name: str) -> Path:
        """The path of ``name`` (``kube-apiserver`` ... ``helm``)."""
        return self.directory / name


def cache_root() -> Path:
    """The cache root, ``$OMNISTAGE_CACHE`` or ``~/.cache/omnistage``."""
    env = os.environ.get("OMNISTAGE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "omnistage"


def go_binary() -> str:
    """The ``go`` command: on PATH, else the machine image's /usr/local/go."""
    found = shutil.which("go")
    if found:
        return found
    if Path("/usr/local/go/bin/go").is_file():
        return "/usr/local/go/bin/go"
    raise BuildError("Go is required to build the control plane: no `go` on PATH")


def go_env() -> dict[str, str]:
    """Environment for every go command: caches under the cache root, no toolchain download."""
    root = cache_root()
    env = dict(os.environ)
    env.update(
        GOMODCACHE=str(root / "go" / "mod"),
        GOCACHE=str(root / "go" / "build"),
        GOTOOLCHAIN="local",
        CGO_ENABLED="0",
        GOFLAGS="-mod=readonly",
    )
    return env


def ldflags(module_dir: Path, build_date: str = "2026-01-01T00:00:00Z") -> str:
    """Link flags: strip symbols and stamp the real versions into the module's binaries."""
    major, minor = K8S_VERSION[1:].split(".")[:2]
    flags = ["-s", "-w"]
    if module_dir in (MODULE_DIR, KUBELET_MODULE_DIR):
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [
                f"-X {pkg}.gitVersion={K8S_VERSION}",
                f"-X {pkg}.gitMajor={major}",
                f"-X {pkg}.gitMinor={minor}",
                f"-X {pkg}.gitTreeState=clean",
                f"-X {pkg}.buildDate={build_date}",
            ]
        return " ".join(flags)
    # helm: its version, and the Kubernetes version its lint/template capabilities assume
    flags += [
        f"-X {HELM_MODULE}/internal/version.version={HELM_VERSION}",
        f"-X {HELM_MODULE}/internal/version.gitTreeState=clean",
        f"-X {HELM_MODULE}/internal/version.metadata=",
        f"-X {HELM_MODULE}/pkg/lint/rules.k8sVersionMajor={major}",
        f"-X {HELM_MODULE}/pkg/lint/rules.k8sVersionMinor={minor}",
        f"-X {HELM_MODULE}/pkg/chartutil.k8sVersionMajor={major}",
        f"-X {HELM_MODULE}/pkg/chartutil.k8sVersionMinor={minor}",
    ]
    return " ".join(flags)


def build_key(builds: tuple[tuple[Path, dict[str, str]], ...] = BUILDS) -> str:
    """Cache key: the versions plus a hash of the module files and the link flags."""
    h = hashlib.sha256()
    for module_dir, packages in builds:
        for name in ("go.mod", "go.sum"):
            path = module_dir / name
            if not path.is_file():
                raise BuildError(f"{path} is missing: run `python -m tests.cluster.build --regen`")
            h.update(path.read_bytes())
        h.update(ldflags(module_dir).encode())
        h.update(" ".join(packages.values()).encode())
    if builds == NODE_BUILDS:
        return f"k8s-{K8S_VERSION}_{h.hexdigest()[:12]}"
    return f"k8s-{K8S_VERSION}_etcd-{ETCD_VERSION}_helm-{HELM_VERSION}_{h.hexdigest()[:12]}"


def bin_dir() -> Path:
    """Where this key's binaries live."""
    return cache_root() / "cluster-bin" / build_key()


def node_bin_dir() -> Path:
    """Where the node binaries (kubelet) of this key live."""
    return cache_root() / "node-bin" / build_key(NODE_BUILDS)


def find_node_binary(name: str = "kubelet") -> Path:
    """A built node binary (``kubelet``, ``kube-proxy``), or BuildError saying how to build it."""
    directory = node_bin_dir()
    if not (directory / "build.json").is_file():
        raise BuildError(
            f"the {name} is not built (looked in {directory}): "
            "run `python -m tests.cluster.build --node`"
        )
    return directory / name


def find_kubelet() -> Path:
    """The built kubelet, or BuildError saying how to build it."""
    return find_node_binary("kubelet")


def binaries_in(directory: Path) -> Binaries:
    """The binaries of a build laid out in ``directory`` (the cache, or an unpacked bundle)."""
    return Binaries(
        apiserver=directory / "kube-apiserver",
        scheduler=directory / "kube-scheduler",
        controller_manager=directory / "kube-controller-manager",
        kubectl=directory / "kubectl",
        etcd=directory / "etcd",
        helm=directory / "helm",
        directory=directory,
    )


def find_binaries() -> Binaries:
    """The built binaries, or BuildError saying how to build them."""
    directory = bin_dir()
    if not (directory / "build.json").is_file():
        raise BuildError(
            f"control-plane binaries are not built (looked in {directory}): "
            "run `python -m tests.cluster.build`"
        )
    return binaries_in(directory)


def build_record() -> dict[str, object]:
    """The build's own record (``build.json``): seconds, cold or warm, date, versions."""
    data: dict[str, object] = json.loads((find_binaries().directory / "build.json").read_text())
    return data


def ready_line(what: str, where: Path, started: float) -> str:
    """What a build CLI prints once ``what`` is in the cache: where (a binary or directory,
    ``build.json`` beside it or in it), the seconds since ``started`` (``time.monotonic()``)
    and the recorded build (seconds, cold or warm when recorded, date)."""
    directory = where if where.is_dir() else where.parent
    record = json.loads((directory / "build.json").read_text())
    cold = f", cold={record['cold']}" if "cold" in record else ""
    return (
        f"{what} ready: {where} ({time.monotonic() - started:.1f}s now; recorded build: "
        f"{record['seconds']}s{cold}, {record['date']})"
    )


def _go_cache_is_cold(gocache: Path) -> bool:
    """Whether the Go build cache holds (almost) nothing compiled yet."""
    if not gocache.is_dir():
        return True
    total = sum(f.stat().st_size for f in gocache.rglob("*") if f.is_file())
    return total < 200 * 1024 * 1024


@contextmanager
def _lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(cmd: list[str], cwd: Path, log: bool = True) -> subprocess.CompletedProcess[str]:
    if log:
        print("+ " + " ".join(cmd), file=sys.stderr, flush=True)
    proc = subprocess.run(
        cmd, cwd=cwd, env=go_env(), text=True, capture_output=not log, check=False
    )
    if proc.returncode != 0:
        detail = (proc.stderr or "") if not log else ""
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{detail}")
    return proc


def ensure_binaries(quiet: bool = False) -> Binaries:
    """Build the binaries unless this key's are already in the cache; return their paths."""
    directory = bin_dir()
    _build_into(directory, BUILDS, PACKAGES, quiet)
    return binaries_in(directory)


def ensure_kubelet(quiet: bool = False) -> Path:
    """Build the kubelet unless this key's is already in the cache; return its path."""
    directory = node_bin_dir()
    _build_into(directory, NODE_BUILDS, NODE_PACKAGES, quiet)
    return directory / "kubelet"


def _build_into(
    directory: Path,
    builds: tuple[tuple[Path, dict[str, str]], ...],
    packages_built: dict[str, str],
    quiet: bool,
) -> None:
    """One ``go build`` per wrapper module of ``builds`` into ``directory`` (with build.json)."""
    with _lock(directory.parent / ".lock"):
        if (directory / "build.json").is_file():
            return
        root = cache_root()
        cold = _go_cache_is_cold(root / "go" / "build")
        go = go_binary()
        staging = directory.with_name(directory.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        start = time.monotonic()
        if not quiet:
            print(
                f"building {', '.join(packages_built)} into {directory} (cold={cold})", flush=True
            )
        date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        parts: dict[str, float] = {}
        for module_dir, packages in builds:
            t0 = time.monotonic()
            flags = ldflags(module_dir, date)
            cmd = [go, "build", "-trimpath", "-p", "2", "-ldflags", flags, "-o", str(staging)]
            _run([*cmd, *packages.values()], module_dir)
            parts[module_dir.name] = round(time.monotonic() - t0, 1)
            if not quiet:
                print(f"{module_dir.name}: {parts[module_dir.name]:.0f}s", flush=True)
        for name, out in _GO_OUTPUT_NAME.items():
            if name in packages_built:
                (staging / out).rename(staging / name)
        seconds = time.monotonic() - start
        missing = [n for n in packages_built if not (staging / n).is_file()]
        if missing:
            raise BuildError(f"go build produced no {', '.join(missing)} in {staging}")
        record = {
            "seconds": round(seconds, 1),
            "parts": parts,
            "cold": cold,
            "date": date,
            "cpus": os.cpu_count(),
            "k8s": K8S_VERSION,
            "etcd": ETCD_VERSION,
            "helm": HELM_VERSION,
            "go": subprocess.run(
                [go, "version"], capture_output=True, text=True, check=False
            ).stdout.strip(),
        }
        (staging / "build.json").write_text(json.dumps(record, indent=2) + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        staging.rename(directory)
        if not quiet:
            print(f"built in {seconds:.0f}s ({'cold' if cold else 'warm'} Go cache)", flush=True)


def regenerate() -> None:
    """Rewrite go.mod, go.sum and tools.go from the Kubernetes release's go.mod (network)."""
    go = go_binary()
    MODULE_DIR.mkdir(parents=True, exist_ok=True)
    info = json.loads(
        _run(
            [go, "mod", "download", "-json", f"k8s.io/kubernetes@{K8S_VERSION}"],
            MODULE_DIR,
            log=False,
        ).stdout
    )
    release = parse_release_gomod(Path(info["GoMod"]).read_text())
    tag = "v0." + K8S_VERSION.split(".", 1)[1]
    published: list[str] = []
    for path in release.staging:
        proc = subprocess.run(
            [go, "list", "-m", "-json", f"{path}@{tag}"],
            cwd=MODULE_DIR,
            env=go_env(),
            text=True,
            capture_output=True,
            check=False,
        )
        if proc.returncode == 0:
            published.append(path)
        else:
            print(f"not published at {tag}, left out: {path}", file=sys.stderr)
    (MODULE_DIR / "go.sum").unlink(missing_ok=True)
    (MODULE_DIR / "go.mod").write_text(
        render_wrapper_gomod(
            "omnistage.test/k8sbuild",
            K8S_VERSION,
            release,
            tuple(published),
            extra_requires=(("go.etcd.io/etcd/server/v3", ETCD_VERSION),),
        )
    )
    (MODULE_DIR / "tools.go").write_text(render_tools_go(tuple(K8S_PACKAGES.values())))
    HELM_MODULE_DIR.mkdir(parents=True, exist_ok=True)
    (HELM_MODULE_DIR / "go.sum").unlink(missing_ok=True)
    (HELM_MODULE_DIR / "go.mod").write_text(
        render_plain_gomod("omnistage.test/helmbuild", release.go, ((HELM_MODULE, HELM_VERSION),))
    )
    (HELM_MODULE_DIR / "tools.go").write_text(render_tools_go(tuple(HELM_PACKAGES.values())))
    KUBELET_MODULE_DIR.mkdir(parents=True, exist_ok=True)
    (KUBELET_MODULE_DIR / "go.sum").unlink(missing_ok=True)
    (KUBELET_MODULE_DIR / "go.mod").write_text(
        render_wrapper_gomod("omnistage.test/kubeletbuild", K8S_VERSION, release, tuple(published))
    )
    (KUBELET_MODULE_DIR / "tools.go").write_text(render_tools_go(tuple(NODE_PACKAGES.values())))
    env = go_env()
    env["GOFLAGS"] = "-mod=mod"
    for module_dir, _ in (*BUILDS, *NODE_BUILDS):
        subprocess.run([go, "mod", "tidy"], cwd=module_dir, env=env, check=True)
    _check_release_versions(info["GoMod"], MODULE_DIR)
    _check_release_versions(info["GoMod"], KUBELET_MODULE_DIR)


def _check_release_versions(release_gomod: str, module_dir: Path) -> None:
    """Fail if tidy moved any dependency of the Kubernetes binaries off the release's version."""
    pinned = requirements(Path(release_gomod).read_text())
    ours = requirements((module_dir / "go.mod").read_text())
    moved = [f"{m} {v} -> {ours[m]}" for m, v in pinned.items() if m in ours and ours[m] != v]
    moved = [line for line in moved if not line.startswith("k8s.io/")]
    if moved:
        raise BuildError("wrapper module moved release dependencies:\n" + "\n".join(moved))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.build", description=__doc__)
    parser.add_argument("--print-bin", metavar="NAME", choices=sorted({*PACKAGES, *NODE_PACKAGES}))
    parser.add_argument("--node", action="store_true", help="build the node binaries (kubelet)")
    parser.add_argument("--regen", action="store_true", help="regenerate the wrapper module")
    args = parser.parse_args(argv)
    try:
        if args.regen:
            regenerate()
            return 0
        if args.print_bin in NODE_PACKAGES:
            print(find_node_binary(args.print_bin))
            return 0
        if args.print_bin:
            print(find_binaries().by_name(args.print_bin))
            return 0
        start = time.monotonic()
        if args.node:
            print(ready_line("kubelet", ensure_kubelet(), start))
            return 0
        print(ready_line("control-plane binaries", ensure_binaries().directory, start))
        return 0
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
