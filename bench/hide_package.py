"""Run a Python script as this venv would, less one installed package (a symlink farm).

The operator's image installs only what its extra needs; this venv has more (``openai`` brings
``sniffio``). To measure a script as it runs where a package is absent, its ``site-packages``
is replaced on ``sys.path`` by a folder of links to every entry but the hidden package's:

    .venv/bin/python bench/hide_package.py sniffio bench/http_pool_cpu.py --out FILE

(``bench/results/README.md``, http_pool_cpu_sniffio*.json).
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path


def farm_without(site: Path, package: str, into: Path) -> Path:
    """A folder linking every entry of ``site`` except ``package``'s module and metadata."""
    into.mkdir(parents=True, exist_ok=True)
    for entry in site.iterdir():
        if entry.name == package or entry.name.startswith(f"{package}-"):
            continue
        (into / entry.name).symlink_to(entry)
    return into


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit("usage: hide_package.py PACKAGE SCRIPT [ARGS...]")
    package, script, *args = sys.argv[1:]
    if package in sys.modules:
        raise SystemExit(f"{package} is imported already at start-up: cannot hide it")
    site = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    farm = farm_without(site, package, Path(tempfile.mkdtemp(prefix="hidden-")))
    sys.path[sys.path.index(str(site))] = str(farm)
    sys.argv = [script, *args]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
