"""Build (or reuse) the real node's NetworkPolicy enforcer, kube-network-policies.

``python -m tests.node.netpol_build`` builds ``sigs.k8s.io/kube-network-policies`` (SIG
Network's NetworkPolicy implementation: nftables rules send the first packet of each connection
to or from a selected pod to an NFQUEUE, where it is judged against the policies) from the Go
module proxy through the wrapper module ``tests/node/netpolbuild``, like the other binaries
(:mod:`tests.cluster.build`: the same Go caches under ``$OMNISTAGE_CACHE``, CGO off). The binary
and ``build.json`` (seconds, date) land in ``netpol-bin/<key>/``, the key naming the
version and a hash of go.mod, go.sum and the link flags; a second run finds them and returns.

``--print-bin`` prints the binary's path (fails if not built); ``--regen`` rewrites the wrapper
module's go.mod/go.sum/tools.go (network).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.cluster.build import (
    KUBELET_MODULE_DIR,
    BuildError,
    cache_root,
    go_binary,
    go_env,
    ready_line,
)
from tests.cluster.gomod import render_plain_gomod, render_tools_go

MODULE = "sigs.k8s.io/kube-network-policies"
VERSION = "v0.8.0"
PACKAGE = f"{MODULE}/cmd"
NAME = "kube-network-policies"
MODULE_DIR = Path(__file__).resolve().parent / "netpolbuild"
LDFLAGS = "-s -w"
GENERATOR = "python -m tests.node.netpol_build --regen"


def build_key() -> str:
    """The version plus a hash of the wrapper module and the link flags."""
    h = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        path = MODULE_DIR / name
        if not path.is_file():
            raise BuildError(f"{path} is missing: run `{GENERATOR}`")
        h.update(path.read_bytes())
    h.update(f"{LDFLAGS} {PACKAGE}".encode())
    return f"knp-{VERSION}_{h.hexdigest()[:12]}"


def bin_dir() -> Path:
    """Where this key's binary lives."""
    return cache_root() / "netpol-bin" / build_key()


def find_enforcer() -> Path:
    """The built enforcer, or BuildError saying how to build it."""
    directory = bin_dir()
    if not (directory / "build.json").is_file():
        raise BuildError(
            f"{NAME} is not built (looked in {directory}): run `python -m tests.node.netpol_build`"
        )
    return directory / NAME


def ensure_enforcer(quiet: bool = False) -> Path:
    """Build the enforcer unless this key's is already in the cache; return its path."""
    directory = bin_dir()
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / "build.json").is_file():
            _build(directory, quiet)
    return directory / NAME


def _build(directory: Path, quiet: bool) -> None:
    go = go_binary()
    gocache = cache_root() / "go" / "build"
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = [go, "build", "-trimpath", "-p", "2", "-ldflags", LDFLAGS, "-o", str(staging / NAME)]
    if not quiet:
        print(f"building {NAME} {VERSION} into {directory} (GOCACHE {gocache})", flush=True)
    start = time.monotonic()
    proc = subprocess.run([*cmd, PACKAGE], cwd=MODULE_DIR, env=go_env(), check=False)
    if proc.returncode != 0:
        raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)} {PACKAGE}")
    seconds = time.monotonic() - start
    record = {
        "seconds": round(seconds, 1),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpus": os.cpu_count(),
        "module": f"{MODULE}@{VERSION}",
        "go": subprocess.run(
            [go, "version"], capture_output=True, text=True, check=False
        ).stdout.strip(),
    }
    (staging / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    if not quiet:
        print(f"built in {seconds:.0f}s", flush=True)


def regenerate() -> None:
    """Rewrite the wrapper module (go line: the Kubernetes wrapper's) and tidy it (network)."""
    found = re.search(r"^go\s+(\S+)", (KUBELET_MODULE_DIR / "go.mod").read_text(), re.MULTILINE)
    if found is None:
        raise BuildError(f"{KUBELET_MODULE_DIR / 'go.mod'} has no go line")
    MODULE_DIR.mkdir(parents=True, exist_ok=True)
    (MODULE_DIR / "go.sum").unlink(missing_ok=True)
    gomod = render_plain_gomod("omnistage.test/netpolbuild", found.group(1), ((MODULE, VERSION),))
    (MODULE_DIR / "go.mod").write_text(gomod.replace("python -m tests.cluster.build", GENERATOR))
    tools = render_tools_go((PACKAGE,)).replace("python -m tests.cluster.build", GENERATOR)
    (MODULE_DIR / "tools.go").write_text(tools)
    env = go_env()
    env["GOFLAGS"] = "-mod=mod"
    subprocess.run([go_binary(), "mod", "tidy"], cwd=MODULE_DIR, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.node.netpol_build", description=__doc__)
    parser.add_argument("--print-bin", action="store_true", help="print the binary's path")
    parser.add_argument("--regen", action="store_true", help="regenerate the wrapper module")
    args = parser.parse_args(argv)
    try:
        if args.regen:
            regenerate()
        elif args.print_bin:
            print(find_enforcer())
        else:
            start = time.monotonic()
            print(ready_line(NAME, ensure_enforcer(), start))
        return 0
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
