"""bench/hide_package.py: a site-packages seen without one package, and a script run there."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.hide_package import farm_without

ROOT = Path(__file__).resolve().parents[2]


def test_the_farm_links_everything_but_the_package_and_its_metadata(tmp_path: Path) -> None:
    site = tmp_path / "site"
    for name in ("sniffio", "sniffio-1.3.1.dist-info", "sniffio_extra", "httpx"):
        (site / name).mkdir(parents=True)
    (site / "six.py").touch()
    farm = farm_without(site, "sniffio", (tmp_path / "farm"))
    names = sorted(p.name for p in farm.iterdir())
    assert names == ["httpx", "six.py", "sniffio_extra"]
    assert (farm / "httpx").resolve() == site / "httpx"


def test_a_script_run_there_cannot_import_the_package(tmp_path: Path) -> None:
    script = tmp_path / "probe.py"
    script.write_text(
        "import importlib.util, sys\n"
        "found = [importlib.util.find_spec(n) is not None for n in ('sniffio', 'httpx')]\n"
        "print(found, sys.argv[1:])\n"
    )
    run = [sys.executable, str(ROOT / "bench" / "hide_package.py"), "sniffio", str(script), "-x"]
    out = subprocess.run(run, check=True, capture_output=True, text=True, timeout=120).stdout
    assert out.strip() == "[False, True] ['-x']"
