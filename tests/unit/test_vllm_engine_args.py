"""``spec.vllm`` reaches the worker as flags its argparse knows, validated on both sides (issue 9).

Before: ``worker.args`` were the only way, the worker refused unknown flags, and vLLM always ran
with its default of 90% of the GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from omnistage_operator.api.spec import SpecError, VllmSettings
from omnistage_operator.api.spec_parse import parse_stage
from omnistage_operator.k8s.builders import build_worker_pod, owner_reference
from omnistage_operator.k8s.pod_hash import pod_spec_hash
from omnistage_worker.cli import build_parser, config_from_args
from omnistage_worker.config import ConfigError, VllmArgs

GI = 1 << 30


def body(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "runner": "AR",
        "backend": "VLLM",
        "image": "omnistage/omnistage-worker-vllm:0.1.0",
        "model": {"path": "/models/llm"},
        "colocation": {"group": "g1"},
        "gpus": 2,
    }
    base.update(spec)
    return {
        "apiVersion": "omnistage.io/v1alpha1",
        "kind": "OmniStage",
        "metadata": {"name": "llm", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": base,
    }


def args_of(manifest: dict[str, Any]) -> list[str]:
    stage = parse_stage(manifest)
    pod = build_worker_pod(stage, initial_state=stage.state, owner=owner_reference(manifest))
    args: list[str] = pod["spec"]["containers"][0]["args"]
    return args


def test_spec_vllm_becomes_worker_flags_the_worker_accepts(tmp_path: Path) -> None:
    manifest = body(vllm={"maxModelLen": 4096, "gpuMemoryUtilization": 0.45, "enforceEager": True})
    assert parse_stage(manifest).vllm == VllmSettings(4096, 0.45, True)
    args = args_of(manifest)
    tail = args[args.index("--vllm-tensor-parallel-size") :]
    assert tail == [
        "--vllm-tensor-parallel-size", "2", "--vllm-max-model-len", "4096",
        "--vllm-gpu-memory-utilization", "0.45", "--vllm-enforce-eager",
    ]  # fmt: skip

    # The worker's own parser takes them (with the pod's other flags made local).
    local = [a for a in args if not a.startswith("--host=")]
    local[local.index("--model") + 1] = str(tmp_path)
    local = [a for a in local if a not in {"--token-file", "/var/run/secrets/omnistage/token"}]
    config = config_from_args(build_parser({}).parse_args(local))
    assert config.vllm == VllmArgs(4096, 0.45, None, True, 2)


def test_utilization_is_derived_from_the_vram_request() -> None:
    args = args_of(body(vram={"request": "20Gi"}))
    assert args[args.index("--vllm-memory-bytes") + 1] == str(20 * GI)
    assert "--vllm-gpu-memory-utilization" not in args
    # Per device: 20 GiB over 2 GPUs of 80 GiB each.
    engine = VllmArgs(memory_bytes=20 * GI, tensor_parallel_size=2)
    assert engine.utilization(80 * GI, 70 * GI) == pytest.approx(0.125)
    with pytest.raises(ConfigError, match=r"only .* are free now"):
        engine.utilization(80 * GI, 5 * GI)
    # Neither given: the free memory at start, less 2%.
    assert VllmArgs().utilization(80 * GI, 40 * GI) == pytest.approx(0.48)


def test_engine_args_change_the_pod_hash_only_for_vllm() -> None:
    a = parse_stage(body(vllm={"maxModelLen": 1024}))
    b = parse_stage(body(vllm={"maxModelLen": 2048}))
    assert pod_spec_hash(a) != pod_spec_hash(b)


@pytest.mark.parametrize(
    ("spec", "field"),
    [
        ({"vllm": {"gpuMemoryUtilization": "half"}}, "spec.vllm.gpuMemoryUtilization"),
        ({"vllm": {"maxModelLen": "long"}}, "spec.vllm.maxModelLen"),
        ({"vllm": {"enforceEager": "yes"}}, "spec.vllm.enforceEager"),
        ({"vllm": "eager"}, "spec.vllm"),
    ],
)
def test_unreadable_engine_args_are_refused_naming_the_field(
    spec: dict[str, Any], field: str
) -> None:
    """Bounds and "backend VLLM only" are the CRD's rules (test_crd_validation) and the
    worker's (below); the parser refuses what it cannot read."""
    with pytest.raises(SpecError) as info:
        parse_stage(body(**spec))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--vllm-gpu-memory-utilization", "1.2"], "--vllm-gpu-memory-utilization"),
        (["--vllm-gpu-memory-utilization", "nan"], "--vllm-gpu-memory-utilization"),
        (["--vllm-max-model-len", "0"], "--vllm-max-model-len"),
        (["--vllm-tensor-parallel-size", "0"], "--vllm-tensor-parallel-size"),
        (["--vllm-memory-bytes", "-1"], "--vllm-memory-bytes"),
        (["--vllm-attention-backend", "triton; rm"], "--vllm-attention-backend"),
        (
            ["--vllm-memory-bytes", "1Gi", "--vllm-gpu-memory-utilization", "0.5"],
            "--vllm-memory-bytes",
        ),
    ],
)
def test_worker_refuses_bad_engine_flags(tmp_path: Path, flags: list[str], flag: str) -> None:
    base = ["--runner", "ar", "--backend", "vllm", "--model", str(tmp_path), "--device", "cuda"]
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser({}).parse_args([*base, *flags]))
    assert info.value.flag == flag


def test_engine_flags_need_the_vllm_backend(tmp_path: Path) -> None:
    argv = ["--runner", "ar", "--backend", "transformers", "--model", str(tmp_path)]
    with pytest.raises(ConfigError, match="need --backend vllm"):
        config_from_args(build_parser({}).parse_args([*argv, "--vllm-enforce-eager"]))


def test_engine_options_people_set_reach_the_worker_and_vllm_serve_flags(tmp_path: Path) -> None:
    """spec.vllm's batching and cache options become --vllm-* flags, then vLLM's serve flags."""
    from omnistage_worker.runners.vllm_serve import serve_argv

    manifest = body(vllm={
        "maxNumSeqs": 64, "kvCacheDtype": "fp8", "enablePrefixCaching": False,
        "enableChunkedPrefill": True, "tensorParallelSize": 2,
    })  # fmt: skip
    settings = parse_stage(manifest).vllm
    assert (settings.max_num_seqs, settings.kv_cache_dtype) == (64, "fp8")
    assert (settings.enable_prefix_caching, settings.enable_chunked_prefill) == (False, True)
    args = args_of(manifest)
    assert args[args.index("--vllm-max-num-seqs") + 1] == "64"
    assert args[args.index("--vllm-kv-cache-dtype") + 1] == "fp8"
    assert "--no-vllm-enable-prefix-caching" in args and "--vllm-enable-chunked-prefill" in args
    local = [a for a in args if not a.startswith("--host=")]
    local[local.index("--model") + 1] = str(tmp_path)
    local = [a for a in local if a not in {"--token-file", "/var/run/secrets/omnistage/token"}]
    config = config_from_args(build_parser({}).parse_args(local))
    engine = config.vllm
    assert (engine.max_num_seqs, engine.kv_cache_dtype, engine.tensor_parallel_size) == (
        64,
        "fp8",
        2,
    )
    assert (engine.enable_prefix_caching, engine.enable_chunked_prefill) == (False, True)
    argv = serve_argv(config, 0.5, tokenizer=True)
    assert argv[argv.index("--max-num-seqs") + 1] == "64"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp8"
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert "--no-enable-prefix-caching" in argv and "--enable-chunked-prefill" in argv
    assert "--enable-sleep-mode" in argv and "--skip-tokenizer-init" not in argv


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--vllm-max-num-seqs", "0"], "--vllm-max-num-seqs"),
        (["--vllm-kv-cache-dtype", "int3"], "--vllm-kv-cache-dtype"),
        (["--vllm-tensor-parallel-size", "2"], "--vllm-tensor-parallel-size"),  # --gpus is 1
    ],
)
def test_worker_refuses_bad_batching_flags(tmp_path: Path, flags: list[str], flag: str) -> None:
    base = ["--runner", "ar", "--backend", "vllm", "--model", str(tmp_path), "--device", "cuda"]
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser({}).parse_args([*base, *flags]))
    assert info.value.flag == flag


def test_chat_options_reach_the_worker_and_vllm_serve_flags(tmp_path: Path) -> None:
    """spec.vllm's tool, reasoning and chat template options become --vllm-* flags, then
    vLLM's serve flags (the worker test checks they reach vLLM's app state)."""
    from omnistage_worker.runners.vllm_serve import serve_argv

    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0].content }}")
    manifest = body(gpus=1, vllm={
        "enableAutoToolChoice": True, "toolCallParser": "hermes",
        "reasoningParser": "deepseek_r1", "chatTemplate": str(template),
    })  # fmt: skip
    settings = parse_stage(manifest).vllm
    assert (settings.enable_auto_tool_choice, settings.tool_call_parser) == (True, "hermes")
    assert (settings.reasoning_parser, settings.chat_template) == ("deepseek_r1", str(template))
    args = args_of(manifest)
    assert "--vllm-enable-auto-tool-choice" in args
    assert args[args.index("--vllm-tool-call-parser") + 1] == "hermes"
    local = [a for a in args if not a.startswith("--host=")]
    local[local.index("--model") + 1] = str(tmp_path)
    local = [a for a in local if a not in {"--token-file", "/var/run/secrets/omnistage/token"}]
    engine = config_from_args(build_parser({}).parse_args(local)).vllm
    assert (engine.enable_auto_tool_choice, engine.tool_call_parser) == (True, "hermes")
    assert (engine.reasoning_parser, engine.chat_template) == ("deepseek_r1", template)
    argv = serve_argv(config_from_args(build_parser({}).parse_args(local)), 0.5, tokenizer=True)
    assert "--enable-auto-tool-choice" in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    assert argv[argv.index("--reasoning-parser") + 1] == "deepseek_r1"
    assert argv[argv.index("--chat-template") + 1] == str(template)
    # Unset, no flag: vLLM's defaults (no tools, no reasoning split, the tokenizer's template).
    plain = args_of(body(gpus=1, vllm={"maxModelLen": 64}))
    assert not [a for a in plain if "tool" in a or "reasoning" in a or "template" in a]


@pytest.mark.parametrize(
    ("vllm", "field"),
    [
        ({"toolCallParser": "hermes"}, "spec.vllm.toolCallParser"),
        ({"enableAutoToolChoice": True}, "spec.vllm.toolCallParser"),
        (
            {"enableAutoToolChoice": "yes", "toolCallParser": "hermes"},
            "spec.vllm.enableAutoToolChoice",
        ),
        ({"reasoningParser": 3}, "spec.vllm.reasoningParser"),
        ({"chatTemplate": ["/t"]}, "spec.vllm.chatTemplate"),
    ],
)
def test_unreadable_or_unpaired_chat_options_are_refused_naming_the_field(
    vllm: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as info:
        parse_stage(body(gpus=1, vllm=vllm))
    assert info.value.field == field


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--vllm-tool-call-parser", "hermes"], "--vllm-tool-call-parser"),
        (["--vllm-enable-auto-tool-choice"], "--vllm-tool-call-parser"),
        (
            ["--vllm-enable-auto-tool-choice", "--vllm-tool-call-parser", "x; rm"],
            "--vllm-tool-call-parser",
        ),
        (["--vllm-reasoning-parser", "Deep Seek"], "--vllm-reasoning-parser"),
        (["--vllm-chat-template", "/nowhere/chat.jinja"], "--vllm-chat-template"),
        (["--vllm-chat-template", "chat.jinja"], "--vllm-chat-template"),
    ],
)
def test_worker_refuses_bad_chat_flags(tmp_path: Path, flags: list[str], flag: str) -> None:
    base = ["--runner", "ar", "--backend", "vllm", "--model", str(tmp_path), "--device", "cuda"]
    with pytest.raises(ConfigError) as info:
        config_from_args(build_parser({}).parse_args([*base, *flags]))
    assert info.value.flag == flag


@pytest.mark.parametrize(
    ("flags", "flag"),
    [
        (["--enable-auto-tool-choice", "--tool-call-parser", "nosuch"], "--vllm-tool-call-parser"),
        (["--reasoning-parser", "nosuch"], "--vllm-reasoning-parser"),
    ],
)
def test_parsers_vllm_has_not_registered_are_refused_before_the_engine_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: list[str], flag: str
) -> None:
    """vLLM's own name check (``vllm serve`` runs it before loading), here the stand-in's."""
    from omnistage_worker.runners.vllm_serve import parse_serve_args
    from tests.fakevllm.models import STANDIN_PATH

    monkeypatch.syspath_prepend(str(STANDIN_PATH))
    assert parse_serve_args(["--model", str(tmp_path), "--reasoning-parser", "qwen3"])
    with pytest.raises(ConfigError) as info:
        parse_serve_args(["--model", str(tmp_path), *flags])
    assert info.value.flag == flag
