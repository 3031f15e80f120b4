"""The operator on the GPU host: real control plane, localnode on real GPUs, two real stages.

Run on the lent GPU machine from a copy of the repository, with the bundle that
``python -m bench.gpu_bundle`` built (the control-plane binaries and the wheels the host lacks)::

    python3 bench/gpu_e2e.py --bundle ../.gpubundle --out $OUT/gpu_e2e.json

What it does, in one process tree:

1. unpacks the bundle into ``--work`` (binaries; wheels installed with ``pip --target``) and puts
   ``omnistage-worker`` on PATH (a script calling the worker's ``main``);
2. builds, on the GPU, with random bf16 weights from configs, a Llama-style causal LM of about
   16.6 GiB and a Stable-Diffusion-3-style pipeline (two CLIP text encoders, an MMDiT
   transformer, a VAE) of about 13 GiB, saved in ``--work/models`` (kept between calls);
3. measures the copy limits (pinned H2D/D2H, the CUDA context) in a fresh process;
4. starts an NVML sampler (its own process, ``--period`` seconds, default 5 ms): every process's
   used memory (``nvmlDeviceGetComputeRunningProcesses``) and the device's free memory;
5. starts the real control plane (``tests/cluster/controlplane.py`` with the unpacked binaries;
   without the controller-manager unless the bundle has it), localnode in real-GPU mode (its
   ResourceSlice from NVML, each pod given its allocated device by UUID in
   ``CUDA_VISIBLE_DEVICES``), the operator (``python -m omnistage_operator.cli``), and a
   ballast process that leaves ``room`` bytes free: one stage fits, both do not;
6. applies the two stages, NEITHER with ``vram.request`` (``llm`` Active, ``sd`` Asleep), then
   hands the GPU over ``--switches`` times by ``kubectl patch`` of ``sd``'s ``spec.state``
   (Active, then Asleep: ``llm`` still wants Active and gets it back), timing each from just
   before kubectl starts to the stage's status Active seen by a watch, then one Generate on the
   stage that woke (outside the timing);
7. reports (JSON, with the exact command): every ACK ok; the sampler's peak of the two stages'
   memory together against the room (and ``device_peak_bytes``: with the device's memory
   charged to no process counted, which a hand-off's pieces are); each sleep ACK's
   ``usedAfterBytes`` against the sampler's reading of that worker just after the ACK's finish
   time (within
   max(2 %, 256 MiB)); patch-to-Active p50/p95 and the operator's share (minus the workers'
   sleep and wake durations; the ACK's duration excludes any drain); the copy limits.

``--image-site DIR`` runs the workers (and the harness, the operator and the models' build) from
the worker image's own Python environment, as ``python -m bench.gpu_bundle --image-site`` packed
it and the command unpacked it into ``DIR``: ``DIR`` goes first on ``PYTHONPATH``, before the
bundle's packages and the tree's sources; the report's ``image_env`` says what came from the
image and checks that each distribution left to the host (torch, triton, ``nvidia-*``,
``cuda-toolkit``) is there at the image's version (torch: the same git commit; the index's wheel
says 2.11.0, the CUDA index's 2.11.0+cu130), and that each carried one imports from ``DIR``.

``--check-only`` stops after the mechanics (bundle, wheels, imports, NVML, control plane,
localnode, operator liveness): a call of a minute or two. ``--tiny`` runs the same flow on this
machine without a GPU (tiny models on CPU, localnode's simulated GPU, no sampler), to test the
script.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
HANDOFF_HOST_PATH = "/tmp/osho"
"""``--handoff``'s node directory (each group's under it, ``<namespace>/<group>``)."""

from bench.gpu_e2e_host import SRC_PATHS  # noqa: E402

for _p in reversed(SRC_PATHS):
    sys.path.insert(0, str(_p))

from bench.gpu_e2e_analysis import GiB, MiB  # noqa: E402
from bench.gpu_e2e_children import child_ballast, child_limits, child_sampler  # noqa: E402
from bench.gpu_e2e_cluster import (  # noqa: E402
    Operator,
    generate,
    hand_over,
    stage_manifest,
    stage_status,
    start_localnode,
    wait_states,
)
from bench.gpu_e2e_host import image_env, nvml_devices, unpack_bundle, versions  # noqa: E402
from bench.gpu_e2e_models import build_models  # noqa: E402
from bench.gpu_e2e_squeeze import squeeze  # noqa: E402
from bench.gpu_e2e_summary import summarize  # noqa: E402

Json = dict[str, Any]


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_child(args: list[str], timeout: float = 900) -> Json:
    """Run ``python3 bench/gpu_e2e.py <args>`` and parse the JSON it prints last."""
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), *args],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"child {args[0]} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    data: Json = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


# ---- main flow -------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> Json:
    report: Json = {
        "benchmark": "gpu_e2e",
        "command": " ".join(shlex.quote(a) for a in ["python3", *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    commit = ROOT / "COMMIT"
    report["code"] = commit.read_text().strip() if commit.exists() else None
    from tests.cluster.build import binaries_in, find_binaries

    if args.tiny:
        binaries = find_binaries()
        report["bundle"] = None
    else:
        log(f"unpacking {args.bundle} into {work}")
        report["bundle"] = unpack_bundle(args.bundle, work, args.image_site)
        binaries = binaries_in(work / "bin")
        log(f"bundle: {report['bundle']}")
    # the tiny rehearsal runs without it, as the host does when the bundle leaves it out
    args.controller_manager = (
        not args.tiny and "kube-controller-manager" in report["bundle"]["binaries"]
    )
    report["versions"] = versions()
    if args.image_site:
        report["image_env"] = image_env(args.image_site)
        log(f"image env: {report['image_env']['problems'] or 'every version identical'}")
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version(),
                         "cpus": os.cpu_count()}  # fmt: skip
    for mod in ("kopf", "kr8s", "diffusers", "grpc_health.v1.health",
                "omnistage_operator.runtime.handlers", "omnistage_worker.cli",
                "tests.cluster.controlplane"):  # fmt: skip
        importlib.import_module(mod)
    log(f"imports ok; versions {report['versions']}")
    devices: list[Json] = [] if args.tiny else nvml_devices()
    report["devices"] = devices
    if devices:
        report["machine"]["gpu"] = devices[0]["name"]
        report["machine"]["driver"] = devices[0]["driver"]
        log(f"NVML: {devices}")
    if args.check_only:
        import torch

        report["torch_cuda"] = torch.cuda.is_available() and torch.cuda.get_device_name(0)
        report["cluster"] = check_cluster(binaries, work, devices, args)
        return report
    if not args.tiny:
        log("building the models (kept in --work)")
    report["models"] = run_child(
        ["build-models", str(work / "models")]
        + (["--tiny"] if args.tiny else [])
        + (["--small-sd"] if args.small_sd else []),
        1200,
    )
    log(f"models: {report['models']}")
    report["limits"] = None if args.tiny else run_child(["limits"])
    if report["limits"]:
        log(f"limits: {report['limits']}")
    report.update(cluster_run(args, binaries, work, devices, report["models"]))
    return report


def check_cluster(binaries: Any, work: Path, devices: list[Json], args: argparse.Namespace) -> Json:
    from tests.cluster.controlplane import ControlPlane

    out: Json = {}
    crd = ROOT / "crds" / "omnistages.omnistage.io.yaml"
    with ControlPlane(binaries=binaries, controller_manager=args.controller_manager) as cp:
        out["control_plane_start_s"] = round(cp.timings["start"], 2)
        cp.kubectl("apply", "--server-side", "-f", str(crd))
        cp.wait_crd_established("omnistages.omnistage.io")
        ns = cp.create_namespace("gpu")
        nodes, mode = start_localnode(cp.kubeconfig, max(1, len(devices)),
                                devices[0]["total_bytes"] if devices else 80 * GiB,
                                not args.tiny, work / "localnode")  # fmt: skip
        out["localnode_mode"] = mode
        with nodes:
            out["localnode_start_s"] = round(nodes.timings["start"], 2)
            slices = cp.get_json("resourceslices")
            out["resourceslice_devices"] = [
                d["name"] for s in slices["items"] for d in s["spec"].get("devices", [])
            ]
            op = Operator(cp.kubeconfig, ns, work)
            try:
                out["operator_healthy_s"] = round(op.wait_healthy(), 2)
            finally:
                op.stop()
        out["kubectl_version"] = cp.kubectl("version", "--client", "-o", "json").stdout
    log(f"cluster check: {out}")
    return out


def cluster_run(
    args: argparse.Namespace, binaries: Any, work: Path, devices: list[Json], models: Json
) -> Json:
    from tests.cluster.controlplane import ControlPlane

    out: Json = {}
    sampler_file = work / "nvml.samples"
    sampler = None
    ballast = None
    if not args.tiny:
        sampler = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "sampler",
                                    str(sampler_file), str(args.period), "0"])  # fmt: skip
    crd = ROOT / "crds" / "omnistages.omnistage.io.yaml"
    runs: list[Json] = []
    try:
        with ControlPlane(binaries=binaries, controller_manager=args.controller_manager) as cp:
            out["control_plane_start_s"] = round(cp.timings["start"], 2)
            cp.kubectl("apply", "--server-side", "-f", str(crd))
            cp.wait_crd_established("omnistages.omnistage.io")
            ns = cp.create_namespace("gpu")
            os.environ["KUBECONFIG"] = str(cp.kubeconfig)
            if devices:
                gpu_memory = devices[0]["total_bytes"]
            else:  # the fake device: one tiny stage fits, both do not
                sizes = sorted((models["llm_weight_bytes"], models["sd_weight_bytes"]))
                gpu_memory = sizes[1] + sizes[0] // 2
            nodes, mode = start_localnode(cp.kubeconfig, max(1, len(devices)), gpu_memory,
                                    not args.tiny, work / "localnode")  # fmt: skip
            out["localnode_mode"] = mode
            with nodes:
                node = nodes.node_names[0]
                # tiny stages on a device of a few hundred KiB: the e2e tests' 16 KiB margin
                extra = ("--wake-margin-bytes", "16384") if args.tiny else ()
                # either mode named, whatever the operator's default
                mode = "--overlapped-handover" if args.overlapped else "--no-overlapped-handover"
                extra = (*extra, mode)
                out["overlapped_handover"] = args.overlapped
                if args.handoff:  # a short node directory: a socket's path holds 107 bytes
                    extra = (*extra, f"--handoff-host-path={HANDOFF_HOST_PATH}")
                out["handoff"] = args.handoff
                op = Operator(cp.kubeconfig, ns, work, extra)
                try:
                    op.wait_healthy()
                    if not args.tiny:
                        ballast, out["room"] = start_ballast(work, models)
                        log(f"room: {out['room']}")
                    device = "cpu" if args.tiny else "cuda"
                    mdir = work / "models"
                    cp.apply(
                        stage_manifest("llm", mdir / "llm", node, "Active", device), namespace=ns
                    )
                    cp.apply(
                        stage_manifest("sd", mdir / "sd", node, "Asleep", device), namespace=ns
                    )
                    start = time.monotonic()
                    wait_states(cp, ns, {"llm": "Active", "sd": "Asleep"}, args.settle_timeout)
                    out["settle_s"] = round(time.monotonic() - start, 1)
                    log(f"settled in {out['settle_s']}s")
                    if args.generate and not args.tiny:
                        out["first_generate_s"] = round(generate(cp, ns, "llm", args.tiny), 3)
                    for i in range(args.switches):
                        state = "Active" if i % 2 == 0 else "Asleep"
                        r = hand_over(cp, ns, state)
                        if args.generate and not args.tiny:  # the tiny device has no room
                            r["generate_s"] = generate(cp, ns, r["gainer"], args.tiny)
                        runs.append(r)
                        log(_switch_line(i, r))
                        time.sleep(0.5)  # the loser's Waiting status settles
                    out["final_status"] = {s: stage_status(cp, ns, s) for s in ("llm", "sd")}
                    if args.squeeze and not args.tiny:
                        out["squeeze"] = squeeze(cp, ns, work, args)
                        log(f"squeeze: {out['squeeze']}")
                except BaseException:
                    log("FAILED; operator log tail:\n" + op.tail(120))
                    for s in ("llm", "sd"):
                        try:
                            log(f"{s} status: {json.dumps(stage_status(cp, ns, s))}")
                        except Exception as exc:
                            log(f"{s} status unreadable: {exc}")
                    raise
                finally:
                    op.stop()
                    copy_logs(work, nodes, cp, args.logs)
    finally:
        if ballast is not None:
            ballast.terminate()
            ballast.wait(30)
        if sampler is not None:
            sampler.send_signal(signal.SIGTERM)
            sampler.wait(30)
    out["runs"] = runs
    out.update(summarize(runs, sampler_file if sampler else None, out.get("room"), args))
    return out


def _switch_line(i: int, r: Json) -> str:
    return (
        f"switch {i + 1:2d} -> {r['gainer']}: total {r['total_s'] * 1000:7.1f} ms "
        f"(kubectl {r['kubectl_s'] * 1000:5.0f}), workers {r['worker_s'] * 1000:6.1f} ms, "
        f"operator {r['operator_s'] * 1000:6.1f} ms, acks ok {r['acks_ok']}"
    )


def start_ballast(work: Path, models: Json) -> tuple[subprocess.Popen[bytes], Json]:
    """A process holding all free memory but ``room``: the larger stage + 2 contexts + headroom."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    larger = max(models["llm_weight_bytes"], models["sd_weight_bytes"])
    target_room = larger + 2 * 640 * MiB + 3 * GiB
    free = int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
    nbytes = free - target_room - 640 * MiB  # the ballast's own context
    ready = work / "ballast.ready"
    ready.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "ballast",
                             str(nbytes), str(ready)])  # fmt: skip
    deadline = time.monotonic() + 120
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("ballast did not start")
        time.sleep(0.1)
    time.sleep(0.5)
    room = int(pynvml.nvmlDeviceGetMemoryInfo(h).free)
    both = models["llm_weight_bytes"] + models["sd_weight_bytes"]
    return proc, {"ballast_bytes": nbytes, "room_bytes": room, "both_weights_bytes": both,
                  "only_one_fits": room < both}  # fmt: skip


def copy_logs(work: Path, nodes: Any, cp: Any, dest: Path | None) -> None:
    if dest is None:
        return
    import shutil

    dest.mkdir(parents=True, exist_ok=True)
    for src in [work / "operator.log", nodes.log, cp.logs("kube-apiserver")]:
        if src.exists():
            shutil.copy(src, dest / src.name)
    pods = work / "localnode" / "pods"
    lines = []
    for f in sorted(pods.rglob("*.log")) if pods.exists() else []:
        lines.append(f"===== {f}\n" + "\n".join(f.read_text(errors="replace").splitlines()[-150:]))
    (dest / "pods.log").write_text("\n".join(lines))


def resummarize(report_path: Path, samples: Path, work: Path) -> int:
    """Recompute a report's summary from its runs and the sampler's file (``resummarize
    REPORT SAMPLES WORK``, WORK as on the host: the stages' model paths name their pids)."""
    report = json.loads(report_path.read_text())
    args = argparse.Namespace(work=work, period=report["sampler"]["target_period_ms"] / 1000)
    report.update(summarize(report["runs"], samples, report.get("room"), args))
    report["resummarized"] = datetime.now(UTC).isoformat(timespec="seconds")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "resummarize":
        return resummarize(Path(argv[1]), Path(argv[2]), Path(argv[3]))
    if argv and argv[0] in ("build-models", "limits", "ballast", "sampler"):
        return child_main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bundle", type=Path, default=ROOT.parent / ".gpubundle")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpue2e"))
    p.add_argument("--out", type=Path)
    p.add_argument("--logs", type=Path, help="copy the operator/localnode/pod logs here")
    p.add_argument("--switches", type=int, default=20)
    p.add_argument("--period", type=float, default=0.005, help="NVML sampler period (s)")
    p.add_argument("--settle-timeout", type=float, default=300)
    p.add_argument("--no-generate", dest="generate", action="store_false")
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CPU rehearsal with tiny models")
    p.add_argument(
        "--image-site",
        type=Path,
        help="the worker image's packages (bench.gpu_bundle --image-site), first on the path",
    )
    p.add_argument(
        "--overlapped",
        action="store_true",
        help="the operator runs overlapped hand-overs (--overlapped-handover); without it, "
        "serial ones (--no-overlapped-handover)",
    )
    p.add_argument(
        "--handoff",
        action="store_true",
        help=f"with --overlapped: the operator gives the group's pods a shared hand-off "
        f"directory under {HANDOFF_HOST_PATH} (--handoff-host-path), so the device pieces "
        "are handed over instead of freed",
    )
    p.add_argument(
        "--small-sd",
        action="store_true",
        help="the diffusion stage in its tiny configuration (less disk and time)",
    )
    p.add_argument(
        "--squeeze",
        action="store_true",
        help="after the switches: a tenant squeezes the device, llm is patched Active",
    )
    p.add_argument(
        "--squeeze-free",
        type=int,
        default=int(7.7 * GiB),
        help="free bytes the tenant leaves (below llm's footprint)",
    )
    p.add_argument(
        "--squeeze-hold", type=float, default=10.0, help="seconds llm is watched while squeezed"
    )
    args = p.parse_args(argv)
    if args.handoff and not args.overlapped:
        p.error("--handoff: pieces are handed over only in overlapped hand-overs (--overlapped)")
    report = run(args)
    from bench.reporting import emit

    emit(report, args.out)
    return 0


def child_main(argv: list[str]) -> int:
    kind, rest = argv[0], argv[1:]
    if kind == "build-models":
        print(json.dumps(build_models(Path(rest[0]), "--tiny" in rest, "--small-sd" in rest)))
    elif kind == "limits":
        print(json.dumps(child_limits()))
    elif kind == "ballast":
        child_ballast(int(rest[0]), Path(rest[1]))
    elif kind == "sampler":
        child_sampler(Path(rest[0]), float(rest[1]), int(rest[2]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
