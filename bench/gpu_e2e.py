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
   memory together against the room; each sleep ACK's ``usedAfterBytes`` against the
   sampler's reading of that worker just after the ACK's finish time (within
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
import lzma
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SRC_PATHS = [
    ROOT / "operator" / "src",
    ROOT / "worker_image" / "src",
    ROOT / "protos" / "gen" / "python",
    ROOT,
]
for _p in reversed(SRC_PATHS):
    sys.path.insert(0, str(_p))

from bench.gpu_e2e_analysis import (  # noqa: E402
    GiB,
    MiB,
    ack_agreement,
    peak_together,
    percentile,
    read_samples,
    sampler_periods,
)

TOKEN = "gpu-e2e-worker-token"
Json = dict[str, Any]


def log(msg: str) -> None:
    print(f"[gpu_e2e {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. bundle -----------------------------------------------------------------------------


def unpack_bundle(bundle: Path, work: Path, image_site: Path | None = None) -> Json:
    """Binaries into ``work/bin``, packages into ``work/site``; PATH and PYTHONPATH set
    (``image_site`` first, when given)."""
    manifest = json.loads((bundle / "manifest.json").read_text())
    bindir, site, shims = work / "bin", work / "site", work / "shims"
    out: Json = {"compressor": manifest["compressor"], "binaries": manifest["binaries"]}
    start = time.monotonic()
    bindir.mkdir(parents=True, exist_ok=True)
    archive = bundle / manifest["archive"]
    if not all((bindir / n).is_file() for n in manifest["binaries"]):
        if archive.suffix == ".xz":
            extract_xz(archive, bindir)
        else:
            zstd, env = zstd_command(bundle, work)
            out["zstd"] = zstd
            proc = subprocess.Popen(
                [zstd, "-dc", "--long=31", str(archive)], stdout=subprocess.PIPE, env=env
            )
            assert proc.stdout is not None
            with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                tar.extractall(bindir, filter="data")
            if proc.wait() != 0:
                raise RuntimeError(f"zstd failed on {archive}")
    out["unpack_seconds"] = round(time.monotonic() - start, 2)
    start = time.monotonic()
    if not (site / ".installed").is_file():
        if manifest.get("site"):
            extract_xz(bundle / manifest["site"], site)
        else:
            wheels = [str(bundle / "wheels" / w) for w in manifest["wheels"]]
            subprocess.run(
                [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                 "--no-compile", "--no-cache-dir", "--upgrade", "--target", str(site), *wheels],
                check=True,
            )  # fmt: skip
        (site / ".installed").write_text("")
    out["install_seconds"] = round(time.monotonic() - start, 2)
    shims.mkdir(parents=True, exist_ok=True)
    for name, module in (("omnistage-worker", "omnistage_worker.cli"),
                         ("omnistage-operator", "omnistage_operator.cli")):  # fmt: skip
        script = shims / name
        script.write_text(
            f"#!{sys.executable}\nimport sys\nfrom {module} import main\nsys.exit(main())\n"
        )
        script.chmod(0o755)
    paths = [*([str(image_site)] if image_site else []), str(site), *(str(p) for p in SRC_PATHS)]
    for p in reversed(paths):
        if p not in sys.path:
            sys.path.insert(0, p)
    importlib.invalidate_caches()
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [*paths, *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    os.environ["PATH"] = os.pathsep.join([str(shims), str(bindir), os.environ.get("PATH", "")])
    return out


def extract_xz(archive: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    with lzma.open(archive) as fh, tarfile.open(fileobj=fh, mode="r|") as tar:
        tar.extractall(dest, filter="data")


def zstd_command(bundle: Path, work: Path) -> tuple[str, dict[str, str] | None]:
    """The host's ``zstd``, else the bundle's (with its libraries on LD_LIBRARY_PATH)."""
    import shutil

    found = shutil.which("zstd")
    if found:
        return found, None
    tool = work / "zstd-tool"
    extract_xz(bundle / "zstd-tool.tar.xz", tool)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(tool), env.get("LD_LIBRARY_PATH")]))
    return str(tool / "zstd"), env


def versions() -> Json:
    import importlib.metadata as md

    names = ("torch", "transformers", "diffusers", "kopf", "kr8s", "grpcio", "protobuf",
             "nvidia-ml-py", "aiohttp", "click", "httpx")  # fmt: skip
    out: Json = {}
    for n in names:
        try:
            out[n] = md.version(n)
        except md.PackageNotFoundError:
            out[n] = None
    return out


def image_env(image_site: Path) -> Json:
    """Where each of the image's distributions comes from here, checked: the carried ones
    must resolve to ``image_site``, the host's must be at the image's version."""
    import importlib.metadata as md

    record = json.loads((image_site / "IMAGE_SITE.json").read_text())
    host: Json = {}
    carried: Json = {}
    problems = []
    for name, d in record["dists"].items():
        try:
            dist = md.distribution(name)
            version, where = dist.version, Path(str(dist.locate_file(""))).resolve()
        except md.PackageNotFoundError:
            version, where = None, None
        if d["from"] == "host":
            host[name] = {"image": d["version"], "host": version}
            if name in ("pip", "setuptools"):  # the venv's installers: nothing here imports them
                host[name]["compared"] = False
                continue
            if name == "torch":  # the index's wheel says 2.11.0, the CUDA index's 2.11.0+cu130
                same = _torch_git(record.get("torch_version_py", "")) == _torch_git(None)
            else:
                same = version == d["version"]
            if not same:
                problems.append(f"{name}: image {d['version']}, host {version}")
        else:
            carried[name] = d["version"]
            if version != d["version"] or where != image_site.resolve():
                problems.append(f"{name} {d['version']}: resolves to {version} at {where}")
    import torch

    return {
        "image_site": str(image_site),
        "carried_from_image": carried,
        "carried_as": {
            k: sum(1 for d in record["dists"].values() if d["from"] == k)
            for k in ("image files", "cp312 wheel")
        },
        "cp312_wheels": record.get("wheels", []),
        "from_host": host,
        "host_torch": {
            "version": torch.__version__,
            "cuda": torch.version.cuda,
            "git_version": torch.version.git_version,
        },
        "image_torch_version_py": record.get("torch_version_py"),
        "python": platform.python_version(),
        "problems": problems,
        "all_identical": not problems,
    }


def _torch_git(version_py: str | None) -> str | None:
    """The git commit torch was built from: of a ``torch/version.py`` text, or of this torch."""
    if version_py is None:
        import torch

        return str(torch.version.git_version)
    found = re.search(r"^git_version = '([0-9a-f]+)'", version_py, re.MULTILINE)
    return found.group(1) if found else None


def nvml_devices() -> list[Json]:
    import pynvml

    pynvml.nvmlInit()
    out = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        out.append({
            "index": i,
            "name": _s(pynvml.nvmlDeviceGetName(h)),
            "uuid": _s(pynvml.nvmlDeviceGetUUID(h)),
            "total_bytes": int(mem.total),
            "free_bytes": int(mem.free),
            "driver": _s(pynvml.nvmlSystemGetDriverVersion()),
        })  # fmt: skip
    return out


def _s(v: str | bytes) -> str:
    return v.decode() if isinstance(v, bytes) else v


# ---- 2. models (child process, on the GPU) ---------------------------------------------------


def build_models(models: Path, tiny: bool, small_sd: bool = False) -> Json:
    """The LLM and the SD3-style pipeline, random bf16 weights, built on the device, saved
    (``small_sd``: the pipeline in its tiny configuration, for runs about the LLM alone)."""
    import torch

    from bench.sleep_models import llm_config
    from tests.worker.tiny_models import build_causal_lm

    dev = torch.device("cuda:0" if torch.cuda.is_available() and not tiny else "cpu")
    out: Json = {}
    llm = models / "llm"
    if not (llm / ".done").exists():
        start = time.monotonic()
        build_causal_lm(llm)  # its tokenizer (a WordLevel vocabulary) and a tiny model
        if not tiny:
            from transformers import LlamaForCausalLM

            for f in llm.glob("*.safetensors"):
                f.unlink()
            torch.set_default_dtype(torch.bfloat16)
            torch.manual_seed(0)
            with dev:
                model = LlamaForCausalLM(llm_config(False))
            model.save_pretrained(llm, max_shard_size="4GB")
            del model
            torch.set_default_dtype(torch.float32)
        (llm / ".done").write_text("")
        out["llm_build_seconds"] = round(time.monotonic() - start, 1)
    sd = models / "sd"
    if not (sd / ".done").exists():
        start = time.monotonic()
        build_sd3(sd, dev, tiny or small_sd)
        (sd / ".done").write_text("")
        out["sd_build_seconds"] = round(time.monotonic() - start, 1)
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    for name, path in (("llm", llm), ("sd", sd)):
        out[f"{name}_weight_bytes"] = sum(f.stat().st_size for f in path.rglob("*.safetensors"))
    out["sd_components"] = {
        d.name: sum(f.stat().st_size for f in d.glob("*.safetensors"))
        for d in sorted(sd.iterdir())
        if d.is_dir() and any(d.glob("*.safetensors"))
    }
    return out


def build_sd3(directory: Path, dev: Any, tiny: bool) -> None:
    """A Stable-Diffusion-3-style pipeline: CLIP-L and CLIP-G-sized text encoders, a two-layer
    T5 encoder of width 4096 with a word-level tokenizer, an MMDiT transformer (30 blocks of
    width 2304, about 10.7 GiB in bf16) and a 16-channel VAE: about 13 GiB in all."""
    import torch
    from transformers import (
        CLIPTextConfig,
        CLIPTextModelWithProjection,
        CLIPTokenizer,
        T5Config,
        T5EncoderModel,
    )

    from tests.worker.tiny_models import build_causal_lm, write_clip_tokenizer

    diffusers: Any = importlib.import_module("diffusers")  # untyped upstream

    torch.manual_seed(0)
    tok_src = directory.parent / "sd-tokenizer-src"
    write_clip_tokenizer(tok_src)
    tokenizer = CLIPTokenizer.from_pretrained(str(tok_src), model_max_length=77)
    t5_src = directory.parent / "sd-t5-tokenizer-src"
    build_causal_lm(t5_src)  # a word-level fast tokenizer (its tiny model is not used)
    from transformers import AutoTokenizer

    t5_tokenizer = AutoTokenizer.from_pretrained(str(t5_src))
    if tiny:
        dims = [(16, 2, 2), (24, 2, 2)]  # hidden, layers, heads of each text encoder
        t5: Json = {"d_model": 64, "d_ff": 128, "num_layers": 1, "num_heads": 2, "d_kv": 32}
        mmdit: Json = {
            "num_layers": 2,
            "attention_head_dim": 8,
            "num_attention_heads": 2,
            "joint_attention_dim": 64,
            "caption_projection_dim": 16,
            "pooled_projection_dim": 40,
            "sample_size": 8,
            "pos_embed_max_size": 16,
        }
        vae_blocks: tuple[int, ...] = (8, 16)
    else:
        dims = [(768, 12, 12), (1280, 32, 20)]
        t5 = {"d_model": 4096, "d_ff": 10240, "num_layers": 2, "num_heads": 64, "d_kv": 64}
        mmdit = {
            "num_layers": 30,
            "attention_head_dim": 64,
            "num_attention_heads": 36,
            "joint_attention_dim": 4096,
            "caption_projection_dim": 2304,
            "pooled_projection_dim": 2048,
            "sample_size": 128,
            "pos_embed_max_size": 192,
        }
        vae_blocks = (128, 256, 512, 512)
    dtype = torch.float32 if tiny else torch.bfloat16
    torch.set_default_dtype(dtype)
    encoders = []
    with dev:
        for hidden, layers, heads in dims:
            cfg = CLIPTextConfig(
                vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
                num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=77,
                projection_dim=hidden, bos_token_id=0, eos_token_id=1, pad_token_id=2,
            )  # fmt: skip
            encoders.append(CLIPTextModelWithProjection(cfg))
        t5_encoder = T5EncoderModel(
            T5Config(vocab_size=len(t5_tokenizer), feed_forward_proj="gated-gelu", **t5)
        )
        transformer = diffusers.SD3Transformer2DModel(
            patch_size=2, in_channels=16, out_channels=16, **mmdit
        )
        vae = diffusers.AutoencoderKL(
            in_channels=3, out_channels=3, latent_channels=16,
            block_out_channels=vae_blocks,
            down_block_types=("DownEncoderBlock2D",) * len(vae_blocks),
            up_block_types=("UpDecoderBlock2D",) * len(vae_blocks),
            norm_num_groups=8 if tiny else 32, use_quant_conv=False, use_post_quant_conv=False,
            scaling_factor=1.5305, shift_factor=0.0609,
        )  # fmt: skip
    torch.set_default_dtype(torch.float32)
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=vae,
        text_encoder=encoders[0],
        tokenizer=tokenizer,
        text_encoder_2=encoders[1],
        tokenizer_2=tokenizer,
        text_encoder_3=t5_encoder,
        tokenizer_3=t5_tokenizer,
    )
    pipe.save_pretrained(str(directory), safe_serialization=True, max_shard_size="4GB")


# ---- children: limits, ballast, sampler ------------------------------------------------------


def child_limits() -> Json:
    from bench.sleep_limits import child_limits as limits

    return limits(4 * GiB)


def child_ballast(nbytes: int, ready: Path) -> None:
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    t.fill_(1)
    torch.cuda.synchronize()
    ready.write_text(str(nbytes))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})


def child_sampler(out: Path, period: float, index: int) -> None:
    """NVML every ``period`` s: ``S t free used pid:bytes ...``; ``P pid cmdline`` once a pid."""
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    stop = False

    def _stop(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    seen: set[int] = set()
    with out.open("w", buffering=1 << 20) as fh:
        nxt = time.monotonic()
        while not stop:
            t = time.time()
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            parts = [f"S {t:.6f} {int(mem.free)} {int(mem.used)}"]
            for p in procs:
                parts.append(f"{p.pid}:{int(p.usedGpuMemory or 0)}")
                if p.pid not in seen:
                    seen.add(p.pid)
                    try:
                        cmd = Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ")
                        fh.write(f"P {p.pid} {cmd.decode(errors='replace').strip()}\n")
                    except OSError:
                        fh.write(f"P {p.pid} ?\n")
            fh.write(" ".join(parts) + "\n")
            nxt += period
            delay = nxt - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            else:
                nxt = time.monotonic()


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


# ---- 5. cluster ------------------------------------------------------------------------------


def start_localnode(
    kubeconfig: Path, gpus: int, gpu_memory: int, real: bool, state: Path
) -> tuple[Any, str]:
    """localnode for one node: the host's GPUs from NVML (``--real-gpus``), else simulated."""
    from tests.cluster.localnode import LocalNodes

    nodes = LocalNodes(
        kubeconfig, nodes=1, gpus=gpus, gpu_memory=gpu_memory, name_prefix="gpu-host-",
        state_dir=state, real_gpus=real,
    )  # fmt: skip
    return nodes, "localnode --real-gpus" if real else "localnode, simulated GPU"


class Operator:
    """``python -m omnistage_operator.cli`` with the admin kubeconfig."""

    def __init__(
        self, kubeconfig: Path, namespace: str, work: Path, extra: tuple[str, ...] = ()
    ) -> None:
        from tests.cluster.procs import free_port

        token = work / "token"
        token.write_text(TOKEN)
        self.liveness = free_port()
        self.metrics = free_port()
        self.log = work / "operator.log"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "PYTHONUNBUFFERED": "1"}
        argv = [sys.executable, "-m", "omnistage_operator.cli", "--namespace", namespace,
                "--worker-token-file", str(token), "--metrics-port", str(self.metrics),
                "--liveness-port", str(self.liveness), *extra]  # fmt: skip
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env)

    def wait_healthy(self, timeout: float = 90) -> float:
        import urllib.request

        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"operator exited {self.proc.returncode}:\n{self.tail()}")
            try:
                url = f"http://127.0.0.1:{self.liveness}/healthz"
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return time.monotonic() - start
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"operator not healthy in {timeout}s:\n{self.tail()}")

    def stop(self) -> None:
        from tests.cluster.procs import terminate

        terminate(self.proc)

    def tail(self, n: int = 80) -> str:
        from tests.cluster.procs import tail_log

        return tail_log(self.log, n)


def stage_manifest(name: str, model: Path, node: str, state: str, device: str) -> Json:
    runner, backend = ("AR", "Transformers") if name == "llm" else ("Diffusion", "Diffusers")
    worker: Json = {"device": device}
    if device == "cuda":
        worker["dtype"] = "bfloat16"
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": name},
        "spec": {
            "runner": runner,
            "backend": backend,
            "image": "omnistage/worker:gpu-e2e",
            "model": {
                "path": "/models/m",
                "mountPath": "/models/m",
                "volume": {"hostPath": {"path": str(model), "type": "Directory"}},
            },
            "state": state,
            "sleepLevel": 1,
            "colocation": {"group": "gpu0", "priority": 0},
            "gpus": 1,
            "worker": worker,
            "template": {"nodeSelector": {"kubernetes.io/hostname": node}},
        },
    }


def stage_status(cp: Any, ns: str, name: str) -> Json:
    obj = cp.get_json("omnistage", name, namespace=ns)
    return dict(obj.get("status") or {})


def wait_states(cp: Any, ns: str, want: dict[str, str], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    seen: dict[str, Any] = {}
    while time.monotonic() < deadline:
        seen = {n: stage_status(cp, ns, n).get("state") for n in want}
        if seen == want:
            return
        time.sleep(0.25)
    raise TimeoutError(f"stages not {want} after {timeout}s: {seen}")


def generate(cp: Any, ns: str, stage: str, tiny: bool) -> float:
    """One Generate on ``stage``'s worker (dialled at its pod IP); returns seconds."""
    import grpc

    from omnistage.worker.v1 import inference_service_pb2, inference_service_pb2_grpc

    pod = cp.get_json("pod", f"{stage}-worker", namespace=ns)
    port = next(
        (p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])), 50051
    )
    req = inference_service_pb2.GenerateRequest(
        request_id=f"g-{time.time_ns()}", prompt="the cat sat on the mat", seed=1
    )
    if stage == "llm":
        req.max_new_tokens = 16
    else:
        req.num_inference_steps = 2
        req.height = req.width = 64 if tiny else 512
    start = time.monotonic()
    with grpc.insecure_channel(f"{pod['status']['podIP']}:{port}") as ch:
        inference_service_pb2_grpc.InferenceServiceStub(ch).Generate(req, timeout=120)
    return time.monotonic() - start


def hand_over(cp: Any, ns: str, state: str) -> Json:
    """Patch sd's wish with kubectl; time it until the gainer's status reads Active."""
    import asyncio

    from bench.operator_switch import _wait_active
    from omnistage_operator.k8s.kube import OMNISTAGE, Kube

    gainer, loser = ("sd", "llm") if state == "Active" else ("llm", "sd")

    async def run() -> Json:
        kube = await Kube.connect()
        current = await kube.get(OMNISTAGE, ns, gainer)
        assert current is not None
        waiter = asyncio.create_task(
            _wait_active(kube, ns, gainer, current["metadata"]["resourceVersion"], 300)
        )
        await asyncio.sleep(0.05)  # the watch connects before the patch
        wall0, t0 = time.time(), time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            str(cp.binaries.kubectl), f"--kubeconfig={cp.kubeconfig}", "patch", "omnistage",
            "sd", "-n", ns, "--type=merge", "-p", json.dumps({"spec": {"state": state}}),
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        t_kubectl = time.monotonic()
        if proc.returncode != 0:
            raise RuntimeError(f"kubectl patch failed: {err.decode()}")
        t1 = await waiter
        return {"gainer": gainer, "loser": loser, "wall_start": wall0,
                "total_s": t1 - t0, "kubectl_s": t_kubectl - t0}  # fmt: skip

    r = asyncio.run(run())
    gain, lose = stage_status(cp, ns, gainer), stage_status(cp, ns, loser)
    r["wake"], r["sleep"] = gain.get("lastAck") or {}, lose.get("lastAck") or {}
    r["gainer_memory"], r["loser_memory"] = gain.get("memory") or {}, lose.get("memory") or {}
    wake, sleep = r["wake"], r["sleep"]
    r["acks_ok"] = bool(
        wake.get("op") == "wake"
        and wake.get("ok")
        and sleep.get("op") == "sleep"
        and sleep.get("ok")
    )
    worker = float(wake.get("durationSeconds") or 0) + float(sleep.get("durationSeconds") or 0)
    r["worker_s"] = worker
    r["operator_s"] = r["total_s"] - worker
    return r


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


def _patch_state(cp: Any, ns: str, stage: str, state: str) -> None:
    cp.kubectl("patch", "omnistage", stage, "-n", ns, "--type=merge",
               "-p", json.dumps({"spec": {"state": state}}))  # fmt: skip


def _free_bytes(index: int = 0) -> int:
    import pynvml

    pynvml.nvmlInit()
    return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).free)


def squeeze(cp: Any, ns: str, work: Path, args: argparse.Namespace) -> Json:
    """Both stages asleep, another tenant takes the device until ``--squeeze-free`` bytes are
    free, then ``llm`` (larger than that) is patched Active: it must get no WakeUp, and its
    status must say why with the figures (device, free, needed, other tenants) within one
    round; once the tenant leaves it wakes."""
    out: Json = {"target_free_bytes": args.squeeze_free}
    _patch_state(cp, ns, "llm", "Asleep")
    wait_states(cp, ns, {"llm": "Asleep", "sd": "Asleep"}, 120)
    before = stage_status(cp, ns, "llm").get("lastAck") or {}
    tenant_bytes = _free_bytes() - args.squeeze_free - 640 * MiB  # its own context
    ready = work / "tenant.ready"
    ready.unlink(missing_ok=True)
    tenant = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "ballast",
                               str(tenant_bytes), str(ready)])  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if tenant.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the tenant did not start")
            time.sleep(0.1)
        time.sleep(0.5)
        out["tenant_bytes"] = tenant_bytes
        out["free_with_tenant_bytes"] = _free_bytes()
        t0 = time.monotonic()
        _patch_state(cp, ns, "llm", "Active")
        seen: Json = {}
        while time.monotonic() - t0 < args.squeeze_hold:
            st = stage_status(cp, ns, "llm")
            if (
                "reason_s" not in out
                and st.get("waitReason")
                and any("other tenants" in e for e in st.get("waitingFor") or ())
            ):
                out["reason_s"] = round(time.monotonic() - t0, 3)
                seen = st
            time.sleep(0.1)
        held = stage_status(cp, ns, "llm")
        ack = held.get("lastAck") or {}
        out["no_wake_while_squeezed"] = ack.get("taskId") == before.get("taskId")
        out["state_while_squeezed"] = held.get("state")
        out["status_when_reason_seen"] = {
            k: seen.get(k) for k in ("state", "waitReason", "waitingFor", "conditions")
        }
        events = cp.get_json("events", namespace=ns)
        out["waiting_events"] = [
            e.get("message") for e in events.get("items", [])
            if e.get("reason") == "Waiting" and e["involvedObject"].get("name") == "llm"
        ]  # fmt: skip
    finally:
        tenant.terminate()
        tenant.wait(30)
    t1 = time.monotonic()
    wait_states(cp, ns, {"llm": "Active"}, 120)
    out["active_after_tenant_left_s"] = round(time.monotonic() - t1, 3)
    woke = stage_status(cp, ns, "llm").get("lastAck") or {}
    out["woke_ok"] = bool(woke.get("op") == "wake" and woke.get("ok"))
    out["ok"] = bool(out.get("reason_s") is not None and out["no_wake_while_squeezed"]
                     and out["woke_ok"])  # fmt: skip
    log(f"squeeze: {out}")
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


def summarize(
    runs: list[Json], sampler_file: Path | None, room: Json | None, args: argparse.Namespace
) -> Json:
    """The figures the issue asks for, from the runs and the sampler's file."""
    total = [r["total_s"] for r in runs]
    operator = [r["operator_s"] for r in runs]
    worker = [r["worker_s"] for r in runs]
    kubectl = [r["kubectl_s"] for r in runs]

    def ms(values: list[float]) -> Json:
        if not values:
            return {}
        return {"p50": round(percentile(values, 0.5) * 1000, 1),
                "p95": round(percentile(values, 0.95) * 1000, 1),
                "max": round(max(values) * 1000, 1)}  # fmt: skip

    out: Json = {
        "switches": len(runs),
        "all_acks_ok": bool(runs) and all(r["acks_ok"] for r in runs),
        "patch_to_active_ms": ms(total),
        "operator_ms": ms(operator),
        "workers_ms": ms(worker),
        "kubectl_ms": ms(kubectl),
    }
    if sampler_file is None or not sampler_file.exists():
        return out
    samples, cmdlines = read_samples(sampler_file)
    stages = {"llm": str(args.work / "models" / "llm"), "sd": str(args.work / "models" / "sd")}
    pids = {s: {pid for pid, cmd in cmdlines.items() if f"{path} " in cmd + " "}
            for s, path in stages.items()}  # fmt: skip
    # the hand-overs: from the first patch to the last switch's Active (+1 s)
    window = (
        (runs[0]["wall_start"], runs[-1]["wall_start"] + runs[-1]["total_s"] + 1.0)
        if runs
        else (0.0, 0.0)
    )
    during = [x for x in samples if window[0] <= x.t <= window[1]]
    out["sampler"] = {
        "samples": len(samples),
        "target_period_ms": args.period * 1000,
        "period_ms": _period_ms(sampler_periods(samples)),
        "samples_during_handovers": len(during),
        "period_ms_during_handovers": _period_ms(sampler_periods(during)),
        "pids": {s: sorted(p) for s, p in pids.items()},
    }
    peak = peak_together(samples, [pids["llm"], pids["sd"]])
    out["peak_together_bytes"] = peak
    if room:
        out["peak_below_room"] = peak <= room["room_bytes"]
    sleeps = [
        {"stage": r["loser"], "time": r["sleep"].get("time"),
         "used_after_bytes": r["sleep"].get("usedAfterBytes")}
        for r in runs if r["sleep"]
    ]  # fmt: skip
    checks = ack_agreement(samples, pids, sleeps)
    out["sleep_ack_vs_sampler"] = checks
    out["sleep_acks_agree"] = bool(checks) and all(c["within"] for c in checks)
    return out


def resummarize(report_path: Path, samples: Path, work: Path) -> int:
    """Recompute a report's summary from its runs and the sampler's file (``resummarize
    REPORT SAMPLES WORK``, WORK as on the host: the stages' model paths name their pids)."""
    report = json.loads(report_path.read_text())
    args = argparse.Namespace(work=work, period=report["sampler"]["target_period_ms"] / 1000)
    report.update(summarize(report["runs"], samples, report.get("room"), args))
    report["resummarized"] = datetime.now(UTC).isoformat(timespec="seconds")
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _period_ms(periods: list[float]) -> Json:
    if not periods:
        return {}
    return {
        "p50": round(percentile(periods, 0.5) * 1000, 2),
        "p99": round(percentile(periods, 0.99) * 1000, 2),
        "max": round(max(periods) * 1000, 2),
    }


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
