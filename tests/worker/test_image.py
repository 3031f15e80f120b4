"""The worker image: no GPU is visible unless the pod's claim grants it."""

from __future__ import annotations

import shlex

import pytest

from tests.unit.test_dockerfiles import DOCKERFILES, parse_dockerfile


def env_of(stage_name: str) -> dict[str, str]:
    """The ENV a target ends with, following its FROM chain inside the Dockerfile."""
    stages = {s.name: s for s in parse_dockerfile(DOCKERFILES["worker"].read_text())}
    chain = []
    name = stage_name
    while name in stages:
        chain.append(stages[name])
        name = stages[name].base
    env: dict[str, str] = {}
    for stage in reversed(chain):
        for arg in stage.args("ENV"):
            env.update(word.split("=", 1) for word in shlex.split(arg))  # type: ignore[misc]
    return env


@pytest.mark.parametrize("target", ["worker", "vllm"])
def test_no_gpu_visible_by_default(target: str) -> None:
    # The CUDA base image says "all": a pod would see every GPU of its node.
    assert env_of(target)["NVIDIA_VISIBLE_DEVICES"] == "void"
