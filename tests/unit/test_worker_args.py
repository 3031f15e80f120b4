"""The worker's command line as the pod builder writes it: exact flags, the device, the epoch,
OnDemand, vLLM pre-warmed asleep at level 2, and the real worker CLI accepts it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from omnistage_operator.api.spec import DesiredState
from omnistage_operator.k8s.builders import (
    INITIAL_STATE_ANNOTATION,
    SLEEP_LEVEL_ANNOTATION,
    build_worker_pod,
)
from omnistage_operator.k8s.pod_hash import pod_spec_hash
from omnistage_operator.k8s.worker_command import start_level, worker_args, worker_device
from tests.unit.stage_bodies import container, make


def test_worker_args_exact() -> None:
    stage, _ = make(worker={"device": "cpu", "dtype": "float32", "args": ["--steps", "2"]})
    assert worker_args(stage, initial_state=DesiredState.ASLEEP) == [
        "--runner", "ar",
        "--backend", "transformers",
        "--model", "/models/tiny-llama",
        "--host=$(POD_IP)",
        "--port", "50051",
        "--initial-state", "asleep",
        "--sleep-level", "1",
        "--token-file", "/var/run/secrets/omnistage/token",
        "--device", "cpu",
        "--drain-timeout", "600",
        "--http-port", "8000",
        "--metrics-port", "9464",
        "--dtype", "float32",
        "--steps", "2",
    ]  # fmt: skip
    assert worker_args(stage, initial_state=DesiredState.ACTIVE, sleep_level=2)[9:13] == [
        "--initial-state", "active", "--sleep-level", "2",
    ]  # fmt: skip
    with pytest.raises(ValueError):
        worker_args(stage, initial_state=DesiredState.ACTIVE, sleep_level=3)


def test_drain_timeout_reaches_the_worker_without_a_new_pod() -> None:
    stage, _ = make(drainTimeoutSeconds=1800)
    args = worker_args(stage, initial_state=DesiredState.ASLEEP)
    assert args[args.index("--drain-timeout") + 1] == "1800"
    # Every Sleep carries the value too, so changing it does not replace a running pod.
    assert pod_spec_hash(stage) == pod_spec_hash(make()[0])


def test_a_stage_on_several_gpus_tells_its_worker() -> None:
    one = worker_args(make()[0], initial_state=DesiredState.ASLEEP)
    assert "--gpus" not in one
    args = worker_args(make(gpus=2)[0], initial_state=DesiredState.ASLEEP)
    assert args[args.index("--gpus") + 1] == "2"


def test_a_new_pod_carries_its_leaders_epoch(tmp_path: Path) -> None:
    """The epoch of the leader that makes the pod reaches the worker (``--epoch``), so it refuses
    older leaders (and epoch 0) before its first order; it does not make the pod outdated."""
    from omnistage_worker.cli import build_parser, config_from_args

    stage, owner = make(model={"path": str(tmp_path)})
    assert "--epoch" not in worker_args(stage, initial_state=DesiredState.ASLEEP)
    pod = build_worker_pod(stage, initial_state=DesiredState.ASLEEP, owner=owner, epoch=9)
    args = container(pod)["args"]
    assert args[args.index("--epoch") + 1] == "9"
    args = [a.replace("$(POD_IP)", "127.0.0.7") for a in args if a != "--token-file"]
    args = [a for a in args if a != "/var/run/secrets/omnistage/token"]
    assert config_from_args(build_parser({}).parse_args(args)).epoch == 9


def test_diffusion_args() -> None:
    stage, _ = make(runner="Diffusion", backend="Diffusers", sleepLevel=2)
    args = worker_args(stage, initial_state=DesiredState.ACTIVE)
    assert args[:4] == ["--runner", "diffusion", "--backend", "diffusers"]
    assert "--dtype" not in args
    assert args[args.index("--device") + 1] == "cuda"  # unset device with GPUs: cuda
    assert args[args.index("--sleep-level") + 1] == "2"


@pytest.mark.parametrize(
    ("device", "gpus", "expected"),
    [(None, 1, "cuda"), ("auto", 2, "cuda"), (None, 0, "cpu"), ("auto", 0, "cpu"),
     ("cpu", 1, "cpu"), ("cuda", 1, "cuda")],
)  # fmt: skip
def test_worker_device_never_auto(device: str | None, gpus: int, expected: str) -> None:
    worker = {} if device is None else {"device": device}
    stage, _ = make(worker=worker, gpus=gpus)
    assert worker_device(stage) == expected
    args = worker_args(stage, initial_state=DesiredState.ACTIVE)
    assert args[args.index("--device") + 1] == expected


@pytest.mark.parametrize(
    "spec",
    [
        {},
        {"runner": "Diffusion", "backend": "Diffusers", "sleepLevel": 2, "worker": {"port": 6000}},
        {"gpus": 0, "worker": {"dtype": "bfloat16"}},
        {"backend": "VLLM", "worker": {"device": "cuda"}},
        {"backend": "VLLM", "worker": {"device": "cuda"}, "sleepLevel": 1},
    ],
)
def test_args_are_accepted_by_the_real_worker_cli(spec: dict[str, Any], tmp_path: Path) -> None:
    """The pod's args, expanded as the kubelet does, parse with the worker's own CLI."""
    from omnistage_worker.cli import build_parser, config_from_args

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    stage, owner = make(**spec, model={"path": str(model_dir)})
    state = DesiredState.ASLEEP
    pod = build_worker_pod(stage, initial_state=state, owner=owner)
    c = container(pod)
    env = {"POD_IP": "127.0.0.7"}
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    token = tmp_path / "token"
    token.write_text("t0k3n")
    args = [str(token) if a == "/var/run/secrets/omnistage/token" else a for a in args]
    assert c["command"] == ["omnistage-worker"]
    config = config_from_args(build_parser({}).parse_args(args))
    assert (config.runner, config.backend) == (stage.runner.cli, stage.backend.cli)
    assert str(config.model) == stage.model.path
    assert (config.host, config.port) == ("127.0.0.7", stage.worker.port)
    level = start_level(stage, state)
    assert (config.initial_state, config.sleep_level) == (state.cli, level)
    assert config.device.kind == ("cuda" if stage.gpus else "cpu")
    assert config.dtype == (stage.worker.dtype or "auto")


@pytest.mark.parametrize("spec_level", [1, 2])
def test_vllm_pod_starts_asleep_pre_warmed_at_level_2(spec_level: int) -> None:
    """A vLLM pod is created asleep like any other; its worker starts pre-warmed (vLLM
    imported, no engine) only at level 2, which it requires, whatever the spec's level or
    an explicit ``sleep_level`` say. Started Active, it keeps the spec's level."""
    stage, owner = make(backend="VLLM", sleepLevel=spec_level)
    for given in (None, 1, 2):
        pod = build_worker_pod(
            stage, initial_state=DesiredState.ASLEEP, owner=owner, sleep_level=given
        )
        args = container(pod)["args"]
        assert args[args.index("--initial-state") + 1] == "asleep"
        assert args[args.index("--sleep-level") + 1] == "2"
        assert pod["metadata"]["annotations"][INITIAL_STATE_ANNOTATION] == "Asleep"
        assert pod["metadata"]["annotations"][SLEEP_LEVEL_ANNOTATION] == "2"
    active = build_worker_pod(stage, initial_state=DesiredState.ACTIVE, owner=owner)
    args = container(active)["args"]
    assert args[args.index("--sleep-level") + 1] == str(spec_level)
    torch, _ = make(sleepLevel=1)
    assert start_level(torch, DesiredState.ASLEEP) == 1
    assert start_level(torch, DesiredState.ASLEEP, 2) == 2


def test_on_demand_worker_args_and_http_port() -> None:
    stage, _ = make(
        activation={"policy": "OnDemand", "holdTimeout": "1m30s", "idleAfter": "5m"},
        worker={"httpPort": 9000},
    )
    args = worker_args(stage, initial_state=DesiredState.ASLEEP)
    assert args[args.index("--http-port") + 1] == "9000"
    assert args[args.index("--activation") + 1] == "ondemand"
    assert args[args.index("--hold-timeout") + 1] == "90"
    manual, _ = make()
    assert "--activation" not in worker_args(manual, initial_state=DesiredState.ASLEEP)
    # the worker's flags changed: a new pod; idleAfter is the operator's alone: same pod
    idle_only, _ = make(
        activation={"policy": "OnDemand", "holdTimeout": "1m30s", "idleAfter": "9m"}
    )
    assert pod_spec_hash(manual) != pod_spec_hash(stage)
    assert pod_spec_hash(idle_only) == pod_spec_hash(
        make(activation={"policy": "OnDemand", "holdTimeout": "1m30s"}, worker={})[0]
    )
