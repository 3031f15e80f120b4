"""operator/ and worker_image/ Dockerfiles: hadolint clean, pinned, non-root, installs that work.

The images themselves are built by `make images` (buildah, tests/node/images.py). Here: hadolint
(the real binary from the dev extra) passes; the structure is checked (pinned bases, USER 65532,
no pip cache, the right extras per target); and the operator image's two RUN steps are executed
as written (paths mapped to a temporary directory) in fresh virtual environments: the build
stage's `pip wheel` on a context holding only what the Dockerfile COPYs, then the runtime stage's
offline install and its `omnistage-operator --help`. The worker's runtime install (torch, CUDA
wheels, vLLM) is not run: only its build stage is, and the wheel's extras are checked.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import venv
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cluster.build import cache_root

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = {
    "operator": REPO_ROOT / "operator" / "Dockerfile",
    "worker": REPO_ROOT / "worker_image" / "Dockerfile",
}
NONROOT = "65532:65532"


@dataclass
class Stage:
    """One FROM section of a Dockerfile: its base, name and instructions (keyword, argument)."""

    base: str
    name: str
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        """Arguments of every ``keyword`` instruction, in order."""
        return [arg for kw, arg in self.instructions if kw == keyword]


def parse_dockerfile(text: str) -> list[Stage]:
    """Split a Dockerfile into stages; continuation lines joined, comment lines dropped."""
    logical: list[str] = []
    current = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    stages: list[Stage] = []
    for line in logical:
        keyword, _, arg = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            parts = arg.split()
            name = parts[2] if len(parts) == 3 and parts[1].upper() == "AS" else ""
            stages.append(Stage(base=parts[0], name=name))
        elif stages:
            stages[-1].instructions.append((keyword, " ".join(arg.split())))
    return stages


def global_args(text: str) -> dict[str, str]:
    """The ``ARG NAME=default`` instructions before the first FROM (the base arguments)."""
    found: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if line.upper().startswith("FROM "):
            break
        m = re.fullmatch(r"ARG\s+(\w+)=(\S+)", line)
        if m:
            found[m.group(1)] = m.group(2)
    return found


def resolve_base(base: str, args: dict[str, str]) -> str:
    """A FROM argument with ``${NAME}`` replaced by the global ARG's default."""
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)


def run_command(arg: str) -> str:
    """The shell command of a RUN argument, without its leading --mount/--network flags."""
    words = arg.split(" ")
    while words and words[0].startswith("--"):
        words.pop(0)
    return " ".join(words)


def _stages(name: str) -> list[Stage]:
    """The stages, each base given as its default (``${PYTHON_IMAGE}`` -> the pinned image)."""
    text = DOCKERFILES[name].read_text()
    args = global_args(text)
    stages = parse_dockerfile(text)
    for stage in stages:
        stage.base = resolve_base(stage.base, args)
    return stages


def _stage(name: str, stage: str) -> Stage:
    found = [s for s in _stages(name) if s.name == stage]
    assert len(found) == 1, f"{name} Dockerfile has no single stage {stage!r}"
    return found[0]


def _hadolint() -> Path:
    path = Path(sys.executable).parent / "hadolint"
    if not path.is_file():
        pytest.fail(
            f"hadolint is missing ({path}): install the dev extra (`make setup`)", pytrace=False
        )
    return path


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_hadolint_is_clean(name: str) -> None:
    proc = subprocess.run(
        [str(_hadolint()), "--no-color", str(DOCKERFILES[name])],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_parser_reads_stages_and_continuations() -> None:
    stages = parse_dockerfile(
        "FROM a:1 AS one\n# note\nRUN x \\\n    && y\nFROM one AS two\nUSER 1:1\n"
    )
    assert [(s.base, s.name) for s in stages] == [("a:1", "one"), ("one", "two")]
    assert stages[0].instructions == [("RUN", "x && y")]
    assert stages[1].args("USER") == ["1:1"]
    assert run_command("--mount=type=bind,source=/w,target=/w pip install x") == "pip install x"


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_base_images_are_pinned_by_version(name: str) -> None:
    text = DOCKERFILES[name].read_text()
    for raw in parse_dockerfile(text):
        # a base is a literal or a global ARG (make images passes its local base), never else
        assert re.fullmatch(r"[^$]+|\$\{(PYTHON_IMAGE|CUDA_IMAGE)\}", raw.base), raw.base
    stages = _stages(name)
    earlier = set()
    for stage in stages:
        if stage.base not in earlier:
            _image, _, tag = stage.base.partition(":")
            assert tag and tag != "latest", f"{stage.base} is not pinned"
            assert re.match(r"\d+\.\d+\.\d+", tag), f"{stage.base}: tag has no full version"
        earlier.add(stage.name)


def test_global_args_resolve_bases() -> None:
    text = "ARG A=x:1.2.3\nARG B=y:4.5.6\nFROM ${A} AS one\nARG C=z\nFROM ${B}\n"
    assert global_args(text) == {"A": "x:1.2.3", "B": "y:4.5.6"}
    assert resolve_base("${B}", global_args(text)) == "y:4.5.6"


def test_operator_base_is_python_3_11_slim() -> None:
    for stage in _stages("operator"):
        assert re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", stage.base), stage.base


def test_worker_runtime_base_is_cuda_runtime() -> None:
    base = _stage("worker", "base").base
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base), base


@pytest.mark.parametrize(
    ("name", "stage"), [("operator", "runtime"), ("worker", "worker"), ("worker", "vllm")]
)
def test_image_targets_run_as_non_root(name: str, stage: str) -> None:
    target = _stage(name, stage)
    keywords = [kw for kw, _ in target.instructions]
    assert target.args("USER")[-1] == NONROOT
    # Nothing runs as root after USER, and the entry point is the stage's program.
    last_user = len(keywords) - 1 - keywords[::-1].index("USER")
    assert "RUN" not in keywords[last_user:]
    assert target.args("ENTRYPOINT"), f"{stage} has no ENTRYPOINT"


@pytest.mark.parametrize(
    ("name", "stage"), [("operator", "runtime"), ("worker", "worker"), ("worker", "vllm")]
)
def test_image_user_has_a_passwd_entry(name: str, stage: str) -> None:
    """getpass.getuser() (torch and kopf ask it) fails without one: found running the images."""
    runs = " ".join(_stage(name, stage).args("RUN"))
    assert "useradd --system --uid 65532 --gid 65532" in runs
    assert "groupadd --system --gid 65532" in runs


def test_default_worker_target_is_the_last_stage() -> None:
    stages = _stages("worker")
    assert stages[-1].name == "worker", "`docker build` without --target must give the worker"
    assert {s.name for s in stages} >= {"build", "base", "vllm", "worker"}


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_pip_never_keeps_a_cache(name: str) -> None:
    """No pip cache in a layer: --no-cache-dir, or a cache kept in a build cache mount."""
    for stage in _stages(name):
        for arg in stage.args("RUN"):
            command = run_command(arg)
            cache_mounts = re.findall(r"--mount=type=cache,target=(\S+?)(?:,|\s)", arg + " ")
            for match in re.finditer(r"pip (install|wheel)\b", command):
                rest = command[match.end() :].split("&&")[0]
                in_mount = any(f"--cache-dir {t}" in rest for t in cache_mounts)
                assert "--no-cache-dir" in rest or in_mount, f"{name}/{stage.name}: {command}"
            if "apt-get install" in command:
                assert "--no-install-recommends" in command
                assert "rm -rf /var/lib/apt/lists/*" in command


def _installs(stage: Stage) -> list[str]:
    return [run_command(a) for a in stage.args("RUN") if "pip install" in a]


def test_pip_cache_is_off_in_the_images() -> None:
    """The worker's install caches in a mount, and PIP_NO_CACHE_DIR comes back after it."""
    for stage in ("worker", "vllm"):
        target = _stage("worker", stage)
        envs = target.args("ENV")
        assert envs and envs[-1] == "PIP_NO_CACHE_DIR=1", f"{stage}: {envs}"
    (install,) = _installs(_stage("worker", "worker"))
    assert "--cache-dir /var/cache/pip" in install
    base_env = " ".join(_stage("worker", "base").args("ENV"))
    assert "PIP_NO_CACHE_DIR" not in base_env, "it would switch the cache mount's cache off"


def test_installs_use_the_constraints_file() -> None:
    """The operator's wheels, the worker's install and `make setup` pin the same versions."""
    (build,) = _stage("operator", "build").args("RUN")
    assert "--constraint constraints.txt" in build
    (install,) = _installs(_stage("worker", "worker"))
    assert "--constraint /opt/omnistage/constraints.txt" in install
    assert "COPY constraints.txt /opt/omnistage/constraints.txt" in [
        f"COPY {a}" for a in _stage("worker", "base").args("COPY")
    ]
    makefile = (REPO_ROOT / "Makefile").read_text()
    assert "--constraint constraints.txt" in makefile
    pins = dict(
        line.split("==", 1)
        for line in (REPO_ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    # the GPU host's torch (bench/results run there); its nvidia-* pins come with it
    assert pins["torch"] == "2.11.0"
    assert not [name for name in pins if name.startswith(("nvidia-", "triton"))]


def test_operator_installs_only_the_operator_extra_offline() -> None:
    (install,) = _installs(_stage("operator", "runtime"))
    assert "[operator]" in install
    assert "worker" not in install and "vllm" not in install
    assert "--no-index" in install, "the runtime stage installs only the build stage's wheels"


@pytest.mark.parametrize(("stage", "extras"), [("worker", "[worker]"), ("vllm", "[worker,vllm]")])
def test_worker_targets_install_their_extras(stage: str, extras: str) -> None:
    (install,) = _installs(_stage("worker", stage))
    assert f'{extras}"' in install
    assert "omnistage-worker --help" in install


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copied_sources_exist(name: str) -> None:
    for stage in _stages(name):
        for arg in stage.args("COPY"):
            if arg.startswith("--from"):
                continue
            *sources, _dest = arg.split()
            for source in sources:
                assert (REPO_ROOT / source).exists(), f"{name}: COPY source {source} is missing"


# --- the install steps, executed ------------------------------------------------------------


def _build_context(stage: Stage, into: Path) -> Path:
    """A build context holding only what ``stage`` COPYs from the repository."""
    for arg in stage.args("COPY"):
        *sources, dest = arg.split()
        for source in sources:
            src = REPO_ROOT / source
            target = into / (source if dest.endswith("/") or dest == "./" else dest)
            target.parent.mkdir(parents=True, exist_ok=True)
            if src.is_dir():
                shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy2(src, target)
    return into


def _fresh_venv(path: Path) -> dict[str, str]:
    """Create a clean virtual environment; the environment variables that activate it."""
    venv.EnvBuilder(with_pip=True, clear=True).create(path)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env.update(
        PATH=f"{path / 'bin'}:{env.get('PATH', '/usr/bin:/bin')}",
        VIRTUAL_ENV=str(path),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    return env


def _as_run_here(arg: str, wheels: Path, pip_cache: Path) -> str:
    """A Dockerfile RUN command with its image paths mapped onto this machine."""
    command = run_command(arg).replace("/wheels", str(wheels))
    # The image keeps no cache; here the shared download cache keeps the test fast.
    return command.replace("--no-cache-dir", f"--cache-dir {shlex.quote(str(pip_cache))}")


def _sh(command: str, cwd: Path, env: dict[str, str], timeout: float) -> None:
    proc = subprocess.run(
        ["/bin/sh", "-c", command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert proc.returncode == 0, (
        f"`{command}` failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


@pytest.mark.slow
def test_operator_image_install_steps_succeed_in_a_clean_venv(tmp_path: Path) -> None:
    started = time.monotonic()
    pip_cache = cache_root() / "pip"
    build = _stage("operator", "build")
    runtime = _stage("operator", "runtime")
    wheels = tmp_path / "wheels"
    context = _build_context(build, tmp_path / "src")

    build_env = _fresh_venv(tmp_path / "build-venv")
    for arg in build.args("RUN"):
        _sh(_as_run_here(arg, wheels, pip_cache), context, build_env, timeout=600)
    assert list(wheels.glob("omnistage-*.whl")), "the build stage made no omnistage wheel"

    runtime_env = _fresh_venv(tmp_path / "runtime-venv")
    (install,) = [a for a in runtime.args("RUN") if "pip install" in a]
    # Runs the install and the `omnistage-operator --help` smoke check the image runs.
    _sh(_as_run_here(install, wheels, pip_cache), tmp_path, runtime_env, timeout=300)
    help_text = subprocess.run(
        [str(tmp_path / "runtime-venv" / "bin" / "omnistage-operator"), "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env=runtime_env,
    ).stdout
    for flag in ("--namespace", "--worker-token-file", "--metrics-port", "--liveness-port"):
        assert flag in help_text, f"omnistage-operator --help lacks {flag}"
    # Only the operator extra: no worker-side heavyweights came in.
    site = next((tmp_path / "runtime-venv" / "lib").glob("python3*/site-packages"))
    for heavy in ("torch", "diffusers", "transformers", "vllm"):
        assert not (site / heavy).exists(), f"{heavy} installed into the operator image"
    print(f"operator image install steps: {time.monotonic() - started:.1f}s")


def test_worker_build_stage_makes_a_wheel_with_both_extras(tmp_path: Path) -> None:
    build = _stage("worker", "build")
    wheels = tmp_path / "wheels"
    context = _build_context(build, tmp_path / "src")
    env = _fresh_venv(tmp_path / "venv")
    for arg in build.args("RUN"):
        _sh(_as_run_here(arg, wheels, cache_root() / "pip"), context, env, timeout=300)
    (wheel,) = wheels.glob("omnistage-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        metadata = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
        entry_points = next(
            zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt")
        )
    assert "Provides-Extra: worker" in metadata
    assert "Provides-Extra: vllm" in metadata
    assert "omnistage-worker = omnistage_worker.cli:main" in entry_points
    assert any(n.startswith("omnistage_worker/") for n in names)
    assert any(n.startswith("omnistage/worker/v1/") for n in names), "generated stubs missing"


def test_vllm_version_is_pinned_in_the_extra_and_the_image() -> None:
    """The worker is tested with one vLLM (wake_up(tags=...) needs a recent one)."""
    extra = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["vllm"]
    assert extra == ["vllm==0.24.0"]
    text = (REPO_ROOT / "worker_image" / "Dockerfile").read_text()
    assert "ARG VLLM_VERSION=0.24.0" in text and '"vllm==${VLLM_VERSION}"' in text
