"""Build (or reuse) the real node's Go tools that are not part of Kubernetes.

``python -m tests.node.gotools [NAME ...]`` builds each tool of :data:`TOOLS` through its own
wrapper module (a ``go.mod`` requiring the released module, a ``tools.go`` importing its
commands), from the Go module proxy, with the caches and flags of :mod:`tests.cluster.build`
(CGO off). Each tool's binaries and ``build.json`` (seconds, date) land in
``<tool>-bin/<key>/`` under the cache root, the key naming the version and a hash of go.mod,
go.sum and the packages; a second run finds them and returns.

* ``containerd``: containerd 1.7 and its runc shim. Debian's containerd (1.6) has no CDI; the
  node's GPUs reach containers through CDI (``enable_cdi``), as a DRA driver's do.
* ``fakegpu-dra``: the node's DRA kubelet plugin for the simulated GPUs (its source is
  ``tests/node/fakegpudra``, this repository's own module).
* ``kube-network-policies``: the node's NetworkPolicy enforcer (SIG Network's implementation:
  nftables rules send the first packet of each connection to or from a selected pod to an
  NFQUEUE, where it is judged against the policies; :mod:`tests.node.netpol` runs it).

``--print-bin NAME`` prints a tool's directory (fails if not built); ``--regen NAME`` rewrites a
wrapper module's go.mod/go.sum/tools.go (network).
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
from dataclasses import dataclass
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

HERE = Path(__file__).resolve().parent
LDFLAGS = "-s -w"


@dataclass(frozen=True)
class GoTool:
    """One wrapper module and the binaries built from it (name -> Go package).

    ``requires``: the released modules it pins (empty: the module is this repository's own
    code, whose go.mod is written by hand and tidied by ``--regen``)."""

    name: str
    module_dir: Path
    packages: dict[str, str]
    requires: tuple[tuple[str, str], ...] = ()

    @property
    def generator(self) -> str:
        return f"python -m tests.node.gotools --regen {self.name}"


CONTAINERD_VERSION = "v1.7.35"
CONTAINERD_CMD = "github.com/containerd/containerd/cmd"
NETPOL = "kube-network-policies"
NETPOL_MODULE = "sigs.k8s.io/kube-network-policies"
NETPOL_VERSION = "v0.8.0"
TOOLS: dict[str, GoTool] = {
    "containerd": GoTool(
        "containerd",
        HERE / "containerdbuild",
        {
            "containerd": f"{CONTAINERD_CMD}/containerd",
            "containerd-shim-runc-v2": f"{CONTAINERD_CMD}/containerd-shim-runc-v2",
        },
        (("github.com/containerd/containerd", CONTAINERD_VERSION),),
    ),
    "fakegpu-dra": GoTool(
        "fakegpu-dra", HERE / "fakegpudra", {"fakegpu-dra": "omnistage.test/fakegpudra"}
    ),
    NETPOL: GoTool(
        NETPOL,
        HERE / "netpolbuild",
        {NETPOL: f"{NETPOL_MODULE}/cmd"},
        ((NETPOL_MODULE, NETPOL_VERSION),),
    ),
}


def build_key(tool: GoTool) -> str:
    """The tool's name plus a hash of its module (go.mod, go.sum, Go sources) and packages."""
    h = hashlib.sha256()
    for name in ("go.mod", "go.sum"):
        path = tool.module_dir / name
        if not path.is_file():
            raise BuildError(f"{path} is missing: run `{tool.generator}`")
        h.update(path.read_bytes())
    for source in sorted(tool.module_dir.glob("*.go")):
        h.update(source.name.encode() + source.read_bytes())
    h.update(f"{LDFLAGS} {sorted(tool.packages.items())}".encode())
    version = "".join(f"-{v}" for _m, v in tool.requires)
    return f"{tool.name}{version}_{h.hexdigest()[:12]}"


def bin_dir(tool: GoTool) -> Path:
    """Where this key's binaries live."""
    return cache_root() / f"{tool.name}-bin" / build_key(tool)


def find_tool(name: str) -> Path:
    """The directory of tool ``name``'s built binaries, or BuildError saying how to build it."""
    directory = bin_dir(TOOLS[name])
    if not (directory / "build.json").is_file():
        raise BuildError(
            f"{name} is not built (looked in {directory}): run `python -m tests.node.gotools`"
        )
    return directory


def ensure_tool(name: str, quiet: bool = False) -> Path:
    """Build tool ``name`` unless this key's build is in the cache; its directory."""
    tool = TOOLS[name]
    directory = bin_dir(tool)
    directory.parent.mkdir(parents=True, exist_ok=True)
    with (directory.parent / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / "build.json").is_file():
            _build(tool, directory, quiet)
    return directory


def _build(tool: GoTool, directory: Path, quiet: bool) -> None:
    go = go_binary()
    staging = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if not quiet:
        print(f"building {', '.join(tool.packages)} into {directory}", flush=True)
    start = time.monotonic()
    for name, package in tool.packages.items():
        cmd = [go, "build", "-trimpath", "-p", "2", "-ldflags", LDFLAGS, "-o", str(staging / name)]
        proc = subprocess.run([*cmd, package], cwd=tool.module_dir, env=go_env(), check=False)
        if proc.returncode != 0:
            raise BuildError(f"command failed ({proc.returncode}): {' '.join(cmd)} {package}")
    seconds = time.monotonic() - start
    record = {
        "seconds": round(seconds, 1),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpus": os.cpu_count(),
        "modules": [f"{m}@{v}" for m, v in tool.requires],
        "go": subprocess.run(
            [go, "version"], capture_output=True, text=True, check=False
        ).stdout.strip(),
    }
    (staging / "build.json").write_text(json.dumps(record, indent=2) + "\n")
    shutil.rmtree(directory, ignore_errors=True)
    staging.rename(directory)
    if not quiet:
        print(f"{tool.name} built in {seconds:.0f}s", flush=True)


def regenerate(tool: GoTool) -> None:
    """Rewrite a pinning wrapper module (go line: the Kubernetes wrapper's), then tidy (network)."""
    if tool.requires:
        found = re.search(r"^go\s+(\S+)", (KUBELET_MODULE_DIR / "go.mod").read_text(), re.M)
        if found is None:
            raise BuildError(f"{KUBELET_MODULE_DIR / 'go.mod'} has no go line")
        tool.module_dir.mkdir(parents=True, exist_ok=True)
        (tool.module_dir / "go.sum").unlink(missing_ok=True)
        module = f"omnistage.test/{tool.module_dir.name}"
        gomod = render_plain_gomod(module, found.group(1), tool.requires)
        (tool.module_dir / "go.mod").write_text(
            gomod.replace("python -m tests.cluster.build --regen", tool.generator)
        )
        tools = render_tools_go(tuple(tool.packages.values()))
        (tool.module_dir / "tools.go").write_text(
            tools.replace("python -m tests.cluster.build --regen", tool.generator)
        )
    env = go_env()
    env["GOFLAGS"] = "-mod=mod"
    subprocess.run([go_binary(), "mod", "tidy"], cwd=tool.module_dir, env=env, check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.node.gotools", description=__doc__)
    parser.add_argument("names", nargs="*", help=f"some of {', '.join(TOOLS)} (default all)")
    parser.add_argument("--print-bin", action="store_true", help="print the tools' directories")
    parser.add_argument("--regen", action="store_true", help="regenerate the wrapper modules")
    args = parser.parse_args(argv)
    names = args.names or list(TOOLS)
    unknown = [n for n in names if n not in TOOLS]
    if unknown:
        print(f"error: unknown tool {', '.join(unknown)} (of {', '.join(TOOLS)})", file=sys.stderr)
        return 2
    try:
        for name in names:
            if args.regen:
                regenerate(TOOLS[name])
            elif args.print_bin:
                print(find_tool(name))
            else:
                start = time.monotonic()
                print(ready_line(name, ensure_tool(name), start))
        return 0
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
