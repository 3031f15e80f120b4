"""bench/vllm_stage.py's pieces that need no GPU: the model's size and names, and the README row
its result renders to (the run itself is checked with ``--smoke``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.report import vllm_section
from bench.vllm_stage_models import LLM_CONFIG, llama_shapes

ROOT = Path(__file__).resolve().parents[2]


def test_the_vllm_model_is_at_least_8_gib_in_bf16() -> None:
    shapes = llama_shapes(LLM_CONFIG)
    params = 0
    for shape in shapes.values():
        n = 1
        for d in shape:
            n *= d
        params += n
    assert params * 2 >= 8 * 1024**3
    assert "lm_head.weight" in shapes and "model.layers.23.mlp.down_proj.weight" in shapes


def test_smoke_run_renders_a_readme_section(tmp_path: Path) -> None:
    """The whole bench on CPU with the stand-in engine, then its README rows."""
    out = tmp_path / "vllm_stage.json"
    subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vllm_stage.py"), "--smoke",
         "--workdir", str(tmp_path / "w"), "--out", str(out), "--l1-cycles", "1",
         "--l2-cycles", "1"],
        check=True, capture_output=True, timeout=600,
    )  # fmt: skip
    data = json.loads(out.read_text())
    s = data["summary"]
    assert s["all_acks_ok"] and s["all_tokens_identical"] and s["deepen_refused"]
    assert s["all_refused_while_asleep"] and s["residual_within_bound"]
    text = "\n".join(vllm_section(data))
    assert "A vLLM stage" in text and "hand-over vLLM -> torch" in text
