"""Issue 23's figures in one JSON: each part runs an existing bench, with the limits it measures.

    python bench/speed.py --work /tmp/speed --out $OUT/speed.json [--bundle .gpubundle]
        [--parts handover,coldstart,vllm,vllm_wake,multi_gpu,operator,overlap]

The parts, each run by calling its bench's ``main`` in a fresh child process (so no part's CUDA
context, environment or imports reach the next one), its report kept as ``--work/parts/NAME.json``:

- ``handover`` (a GPU, ``--bundle``): ``bench/gpu_e2e.py --overlapped``, the real control plane
  and operator handing over as it does by default (overlapped), ``kubectl patch`` -> Active
  against the serial copy bound (bytes out at D2H + bytes in at H2D, the limits measured in that
  run), and the operator's share of each hand-over;
- ``coldstart`` (a GPU): ``bench/coldstart.py``, process spawn to the first token;
- ``vllm`` (a GPU and vLLM importable): ``bench/vllm_stage.py``, level-1 wake against H2D and
  against the same wake's floor without vLLM (``bench/vllm_wake_floor.py``), and the cold start
  of a vLLM stage;
- ``vllm_wake`` (asked for, as ``vllm``): the same bench's level-1 wakes alone (no level 2, no
  restart), and seven hand-overs; where it ran, its wake figures come before ``vllm``'s;
- ``multi_gpu`` (two GPUs): ``bench/multi_gpu.py``, each device's wake against its limit when
  both copy at once;
- ``operator`` (any machine): ``bench/operator_switch.py``, the operator's share of a hand-over
  on the local control plane; the default where ``handover`` cannot run;
- ``overlap`` (a GPU): ``bench/overlap.py --handoff``, overlapped hand-overs between two
  workers (the pieces handed over) against the serial copy bound, an NVML sampler checking the
  room;
- ``handover_serial`` (a GPU, ``--bundle``): ``bench/gpu_e2e.py``, as ``handover`` with the
  operator's ``--no-overlapped-handover`` (every wake after the sleep's ACK).

By default every part this machine can run runs; a part it cannot run, or one that fails, leaves
its keys ``None`` in the summary with the reason in ``summary.missing``. A report
already under ``--work/parts`` is reused (``--fresh`` runs it again), so the parts can run in
consecutive calls on one warm machine; ``--reuse NAME=PATH`` takes a part's report from a file
(the ``multi_gpu`` part from a two-GPU machine). With ``--out``, each part's report and log
are written beside it too, in ``<out's stem>_parts/``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import speed_figures  # noqa: E402
from bench.reporting import code_version, emit  # noqa: E402

Json = dict[str, Any]
SRC_PATHS = [ROOT / "operator" / "src", ROOT / "worker_image" / "src", ROOT / "protos/gen/python"]


@dataclass(frozen=True)
class Machine:
    """What this machine can run: its GPUs (from NVML, which starts no CUDA context) and vLLM."""

    gpus: list[str]
    vllm: bool
    bundle: Path | None

    def cannot(self, part: str) -> str | None:
        """Why ``part`` cannot run here, or None."""
        gpu_parts = ("handover", "handover_serial", "coldstart", "vllm", "vllm_wake", "overlap")
        if part in gpu_parts and not self.gpus:
            return "no GPU on this machine (NVML sees none)"
        if part in ("handover", "handover_serial") and self.bundle is None:
            return "needs --bundle (python -m bench.gpu_bundle: the control plane's binaries)"
        if part in ("vllm", "vllm_wake") and not self.vllm:
            return "vLLM is not importable here (source bench/vllm_host_setup.sh first)"
        if part == "multi_gpu" and len(self.gpus) < 2:
            return f"needs 2 GPUs of one host, NVML sees {len(self.gpus)}"
        return None


def nvml_gpus() -> list[str]:
    """The GPUs' names, or none where NVML has no driver to talk to."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return []
    names = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
        names.append(name.decode() if isinstance(name, bytes) else str(name))
    return names


# ---- the parts: bench module and its arguments ------------------------------------------------


def _handover_serial_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return ["--bundle", str(a.bundle), "--work", str(a.work / "gpu_e2e"), "--out", str(out),
            "--logs", str(a.work / "logs" / "gpu_e2e"), "--switches", str(a.switches)]  # fmt: skip


def _handover_argv(a: argparse.Namespace, out: Path) -> list[str]:
    """The operator's default: overlapped hand-overs where both workers can."""
    return [*_handover_serial_argv(a, out), "--overlapped"]


def _coldstart_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return ["--workdir", str(a.work / "coldstart"), "--runs", str(a.coldstart_runs),
            "--pycache", str(a.work / "pycache"), "--out", str(out),
            *(["--no-cold"] if a.no_cold else [])]  # fmt: skip


def _vllm_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return ["--workdir", str(a.work / "vllm"), "--out", str(out)]


def _vllm_wake_argv(a: argparse.Namespace, out: Path) -> list[str]:
    """The level-1 wakes alone, right after a sleep, rested and in hand-overs, with their floor."""
    return [*_vllm_argv(a, out), "--l1-cycles", "3", "--l2-cycles", "0",
            "--l1-rested-cycles", "3", "--restarts", "0", "--handovers", "7"]  # fmt: skip


def _multi_gpu_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return ["--work", str(a.work / "multi_gpu"), "--out", str(out)]


def _operator_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return ["--switches", str(a.switches), "--out", str(out)]


def _overlap_argv(a: argparse.Namespace, out: Path) -> list[str]:
    return ["--work", str(a.work / "overlap"), "--out", str(out), "--handoff"]


PARTS: dict[str, tuple[str, Callable[[argparse.Namespace, Path], list[str]]]] = {
    "handover": ("gpu_e2e", _handover_argv),
    "coldstart": ("coldstart", _coldstart_argv),
    "vllm": ("vllm_stage", _vllm_argv),
    "vllm_wake": ("vllm_stage", _vllm_wake_argv),
    "multi_gpu": ("multi_gpu", _multi_gpu_argv),
    "operator": ("operator_switch", _operator_argv),
    "overlap": ("overlap", _overlap_argv),
    "handover_serial": ("gpu_e2e", _handover_serial_argv),
}


OPTIONAL = ("operator", "vllm_wake")
"""Parts run only when asked: ``vllm``'s report has the same wakes (``vllm_wake`` gives them
apart, for a report of its own under ``--reuse``)."""


def default_parts(machine: Machine) -> list[str]:
    """Every part this machine can run; the local control plane's operator figure only where
    the GPU hand-over cannot give the operator's share."""
    parts = [p for p in PARTS if p not in OPTIONAL and machine.cannot(p) is None]
    return parts if "handover" in parts else [*parts, "operator"]


def child_env(part: str, original_path: str) -> dict[str, str]:
    """The tree's sources first; for vLLM the path as the host setup left it before the
    bundle's packages (its staging was run that way)."""
    env = dict(os.environ)
    current = env.get("PYTHONPATH", "")
    if part in ("vllm", "vllm_wake") and original_path:
        current = os.pathsep.join([original_path, current])
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in SRC_PATHS), str(ROOT), current])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_part(part: str, a: argparse.Namespace, original_path: str) -> tuple[Json | None, Json]:
    """One part in a child process: its report (None if it failed) and how it ran."""
    module, argv_of = PARTS[part]
    out = a.work / "parts" / f"{part}.json"
    out.unlink(missing_ok=True)
    argv = argv_of(a, out)
    log = a.work / "logs" / f"{part}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    print(f"[speed] {part}: bench/{module}.py {shlex.join(argv)}", flush=True)
    with log.open("w") as fh:
        try:
            code = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), "part", part, *argv],
                env=child_env(part, original_path), stdout=fh, stderr=subprocess.STDOUT,
                timeout=a.part_timeout, check=False,
            ).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = None
    ran: Json = {"bench": f"bench/{module}.py", "argv": shlex.join(argv), "exit": code,
                 "seconds": round(time.monotonic() - started, 1), "log": str(log)}  # fmt: skip
    if code != 0 or not out.exists():
        tail = log.read_text(errors="replace").splitlines()[-5:]
        why = "timed out" if code is None else f"exit {code}"
        ran["failed"] = f"bench/{module}.py {why}: " + " | ".join(tail)
        return None, ran
    return json.loads(out.read_text()), ran


def part_main(part: str, argv: list[str]) -> int:
    """In the child: the bench's own ``main`` with its own command line."""
    module = PARTS[part][0]
    sys.argv = [str(ROOT / "bench" / f"{module}.py"), *argv]
    result = importlib.import_module(f"bench.{module}").main()
    return int(result or 0)


def keep_beside(out: Path, part: str, report: Json | None, log: str | None) -> None:
    """A part's own report and log beside ``out`` (``<stem>_parts/``): they come back with it."""
    beside = out.parent / f"{out.stem}_parts"
    beside.mkdir(parents=True, exist_ok=True)
    if report is not None:
        (beside / f"{part}.json").write_text(json.dumps(report, indent=2) + "\n")
    if log is not None and Path(log).is_file():
        shutil.copy(log, beside / f"{part}.log")


def measure(a: argparse.Namespace, machine: Machine, parts: list[str]) -> Json:
    """Run each part asked for (a report given by ``--reuse`` or already under ``--work``
    is taken instead); the figures of those that ran, the reasons of the others."""
    original_path = os.environ.get("PYTHONPATH", "")
    kept = {p: a.work / "parts" / f"{p}.json" for p in PARTS}
    kept |= {name: Path(path) for name, path in (r.split("=", 1) for r in a.reuse)}
    reuse = {p for p, f in kept.items() if f.is_file() and not (a.fresh and p in parts)}
    to_run = [p for p in parts if p not in reuse and machine.cannot(p) is None]
    if machine.bundle is not None and to_run:
        from bench.gpu_e2e_host import unpack_bundle

        # the binaries on PATH and the packages the host lacks on PYTHONPATH, for every part
        unpack_bundle(machine.bundle, a.work / "gpu_e2e")
    figures: dict[str, Json] = {}
    missing: dict[str, str] = {}
    ran: dict[str, Json] = {}
    for part in PARTS:
        report: Json | None = None
        if part in reuse:
            report, ran[part] = json.loads(kept[part].read_text()), {"reused": str(kept[part])}
        elif part in to_run:
            report, ran[part] = run_part(part, a, original_path)
            if report is None:
                missing[part] = ran[part]["failed"]
        else:
            missing[part] = machine.cannot(part) or "not asked for (--parts)"
        if a.out is not None and part in ran:
            keep_beside(a.out, part, report, ran[part].get("log"))
        if report is not None:
            figures[part] = speed_figures.FIGURES[part](report)
    return {"parts": ran, "figures": figures, "summary": speed_figures.summary(figures, missing)}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "part":
        return part_main(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", type=Path, default=Path("/tmp/speed"))
    p.add_argument("--out", type=Path)
    p.add_argument("--bundle", type=Path, help="python -m bench.gpu_bundle's folder (GPU host)")
    p.add_argument(
        "--parts",
        help=f"comma-separated, of {', '.join(PARTS)} (default: all this machine can run; "
        "'' for none)",
    )
    p.add_argument("--switches", type=int, default=20, help="hand-overs (handover, operator)")
    p.add_argument("--coldstart-runs", type=int, default=3, help="starts with the cache warm")
    p.add_argument("--no-cold", action="store_true", help="coldstart: no cold-cache starts")
    p.add_argument("--part-timeout", type=float, default=1800, help="seconds a part may take")
    p.add_argument("--fresh", action="store_true", help="run parts already under --work again")
    p.add_argument(
        "--reuse",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a part's report from a file (e.g. multi_gpu from a 2-GPU host)",
    )
    a = p.parse_args(argv)
    a.work = a.work.resolve()
    bundle = a.bundle.resolve() if a.bundle else None
    machine = Machine(nvml_gpus(), importlib.util.find_spec("vllm") is not None, bundle)
    parts = default_parts(machine) if a.parts is None else [p for p in a.parts.split(",") if p]
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    report: Json = {
        "benchmark": "speed",
        "command": shlex.join(["python3", "bench/speed.py", *argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "code": code_version(ROOT),
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "gpus": machine.gpus,
            "vllm_importable": machine.vllm,
        },
        "asked": parts,
    }
    report |= measure(a, machine, parts)
    emit(report, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
