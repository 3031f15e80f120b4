"""Staggered arrivals give the batch's attention a few recurring shapes, not a new one per step
(cuDNN builds an attention graph per new masked shape, about 1 ms of host time per layer on an
H200), every request still gets the tokens it gets alone, and the batch's cache is freed as
the last request ends (not left to Python's cycle collector, after a sleep has measured)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from tests.worker.tiny_models import SENTENCES

JOBS = 14


def test_staggered_joins_reuse_a_few_attention_shapes(lm_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from omnistage_worker.runners.decode_batch import DecodeBatcher, Job
    from omnistage_worker.runners.sampling import Sampling

    model: Any = AutoModelForCausalLM.from_pretrained(lm_dir)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    shapes: list[tuple[int, ...]] = []

    def seen(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor):
            shapes.append(tuple(mask.shape))

    attentions = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    hooks = [m.register_forward_pre_hook(seen, with_kwargs=True) for m in attentions]
    batcher = DecodeBatcher(
        model, tokenizer=tokenizer, device=torch.device("cpu"), max_batch=8, eos_ids=set(), pad_id=3
    )

    def prompt(i: int) -> list[int]:  # 2 to 12 tokens
        words = " ".join(SENTENCES[i % 5].split() + SENTENCES[(i + 2) % 5].split())
        return [int(t) for t in tokenizer(" ".join(words.split()[: 2 + i % 11]))["input_ids"]]

    def job(i: int, sink: Any = None) -> Job:
        request = inference_service_pb2.GenerateRequest()
        return Job(request, prompt(i), 24 + 5 * (i % 4), Sampling(greedy=True), sink)

    caches: list[weakref.ref[Any]] = []
    gc.disable()  # what frees the cache must be its last reference going, not a collection
    try:
        alone = [
            list(batcher.submit(job(i)).result(timeout=60).text.token_ids) for i in range(JOBS)
        ]
        shapes.clear()
        steps = batcher.steps
        futures: dict[int, Any] = {}

        def chained(i: int) -> Any:
            """Job ``i``; its fourth token submits job ``i + 1`` (a new arrival every few steps)."""
            count = [0]

            def sink(chunk: inference_service_pb2.TextChunk) -> None:
                count[0] += 1
                if not caches:
                    caches.append(weakref.ref(batcher._cache))
                if count[0] == 4 and i + 1 < JOBS:
                    futures[i + 1] = batcher.submit(chained(i + 1))

            return job(i, sink)

        futures[0] = batcher.submit(chained(0))
        together = [list(futures[i].result(timeout=60).text.token_ids) for i in range(JOBS)]
        steps = batcher.steps - steps
        assert caches[0]() is None  # the batch ended: its cache is gone
    finally:
        gc.enable()
        batcher.close()
        for hook in hooks:
            hook.remove()
    assert together == alone
    assert steps >= 60, steps
    distinct = set(shapes)
    assert len(distinct) <= 16, (steps, sorted(distinct))


def test_a_sliding_window_model_runs_alone_as_generate_does(lm_dir: Path) -> None:
    """With ``max_batch`` 1 (what the runner sets for sliding-window layers) a request runs in
    the model's own cache, unpadded: past the window its tokens are ``generate``'s."""
    import torch
    from transformers import AutoTokenizer, MistralConfig, MistralForCausalLM

    from omnistage_worker.runners.decode_batch import DecodeBatcher, Job
    from omnistage_worker.runners.sampling import Sampling

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=4,
        pad_token_id=tokenizer.pad_token_id,
    )
    model: Any = MistralForCausalLM(config)
    model.eval()
    ids = [int(t) for t in tokenizer("the cat sat on the mat")["input_ids"]]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False)
    expected = [int(t) for t in out[0, len(ids) :]]  # up to its EOS, if it picks one
    assert len(expected) > 12  # three windows of 4
    batcher = DecodeBatcher(
        model, tokenizer=tokenizer, device=torch.device("cpu"), max_batch=1, eos_ids=set(), pad_id=3
    )
    try:
        job = Job(inference_service_pb2.GenerateRequest(), ids, 24, Sampling(greedy=True), None)
        answer = batcher.submit(job).result(timeout=60)
    finally:
        batcher.close()
    assert list(answer.text.token_ids)[: len(expected)] == expected
    assert batcher.cache_bytes() == 0
