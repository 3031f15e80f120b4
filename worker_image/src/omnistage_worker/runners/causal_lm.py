"""Transformers runner: a causal LM and its tokenizer from a local directory."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.engine.placement import Block, blocks_of
from omnistage_worker.runners.base import (
    InvalidRequest,
    TextChunkSink,
    TorchRunner,
    safetensors_in,
)
from omnistage_worker.runners.decode_batch import DecodeBatcher, Job
from omnistage_worker.runners.sampling import resolve_sampling, validate_sampling

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 32


class CausalLMRunner(TorchRunner):
    """Generate returns token ids and text; greedy unless sampling is asked for (then seeded
    per request). Concurrent requests run together (:mod:`.decode_batch`)."""

    runner_kind = types_pb2.RUNNER_AR
    backend_kind = types_pb2.BACKEND_TRANSFORMERS

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.model: Any = None
        self.tokenizer: Any = None
        self._batcher: DecodeBatcher | None = None
        self._encode_thread: concurrent.futures.ThreadPoolExecutor | None = None

    def load(self) -> None:
        """The tokenizer (on its own thread) and the model: built on ``meta`` when its files
        fill it directly (the engine reads them into the device, see :mod:`.meta_model`),
        else with ``from_pretrained`` onto the CPU."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from omnistage_worker.runners.meta_model import build_on_meta

        started = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(1, "omnistage-tokenizer") as pool:
            tokenizer = pool.submit(
                AutoTokenizer.from_pretrained, str(self.model_dir), local_files_only=True
            )
            files = self._files()
            self.resolve_dtype([self.model_dir], files)
            self.model = build_on_meta(self.model_dir, self.dtype, files)
            if self.model is None:
                kwargs: dict[str, Any] = {"local_files_only": True, "dtype": self.dtype}
                if self.config.variant:
                    kwargs["variant"] = self.config.variant
                self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), **kwargs)
                self.model.eval()
            self.tokenizer = tokenizer.result()
        log.info(
            "loaded %s (%s%s) in %.2fs",
            type(self.model).__name__,
            self.model.dtype,
            ", weights to be read from the files" if self.model.device.type == "meta" else "",
            time.monotonic() - started,
        )

    def modules(self) -> Mapping[str, torch.nn.Module]:
        return {"model": self.model}

    def blocks(self) -> list[Block]:
        """Decoder layers (the model's ``_no_split_modules``) and the modules around them."""
        no_split = getattr(self.model, "_no_split_modules", None) or []
        return blocks_of(self.modules(), no_split=no_split)

    def _files(self) -> list[Path]:
        return safetensors_in(self.model_dir, self.config.variant)

    def weight_files(self) -> Mapping[str, Sequence[Path]] | None:
        found = self._files()
        return {"model": found} if found else None

    def validate(self, request: inference_service_pb2.GenerateRequest) -> None:
        if request.HasField("prompt_embeds"):
            raise InvalidRequest("prompt_embeds", "an AR stage takes a prompt, not prompt embeds")
        super().validate(request)
        validate_sampling(request)

    def encode(
        self, request: inference_service_pb2.EncodeRequest
    ) -> inference_service_pb2.EncodeResponse:
        """The prompt's last hidden state (after the final norm) as prompt embeds, every
        token unmasked; each prompt runs alone, so its embeds do not depend on the others."""
        from omnistage_worker.runners.embeds import pack

        started = time.monotonic()
        ids = [int(t) for t in self.tokenizer(request.prompt)["input_ids"]]

        def forward() -> torch.Tensor:
            with self._generate_lock, torch.inference_mode():
                tokens = torch.tensor([ids], device=self.device)
                mask = torch.ones_like(tokens)
                out = self.model.base_model(input_ids=tokens, attention_mask=mask)
                hidden: torch.Tensor = out.last_hidden_state[0]
                return hidden

        # One long-lived thread runs every Encode's forward, whichever request thread asked:
        # CUDA libraries keep per-thread state on the device (cuBLAS handles and workspaces)
        # that a sleep on another thread cannot release. Measured on an H200, a 7B encoder
        # whose Encodes ran on 8 request threads kept 614 MB after its level-1 sleep (about
        # 77 MB a thread) and failed the residual check; on one thread, 79 MB (within it).
        if self._encode_thread is None:
            self._encode_thread = concurrent.futures.ThreadPoolExecutor(1, "omnistage-encode")
        hidden = self._encode_thread.submit(forward).result()
        response = inference_service_pb2.EncodeResponse(
            request_id=request.request_id,
            prompt_embeds=pack(hidden, torch.ones(len(ids), dtype=torch.int64)),
        )
        response.usage.prompt_tokens = len(ids)
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response

    @property
    def max_concurrency(self) -> int:
        return self.config.max_batch

    def batcher(self) -> DecodeBatcher:
        """The batcher that runs this model's requests (made on first use, after loading)."""
        if self._batcher is None:
            tok = self.tokenizer
            pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
            self._batcher = DecodeBatcher(
                self.model,
                tokenizer=tok,
                device=self.device,
                max_batch=self._batch_limit(),
                eos_ids=_eos_ids(self.model, tok),
                pad_id=0 if pad is None else int(pad),
                graphs=self.config.decode_graphs and self.config.gpus == 1,
            )
        return self._batcher

    def _batch_limit(self) -> int:
        """``--max-batch``, or 1 for a model with sliding-window layers (their cache keeps
        a window per row that the batch's shared layout cannot follow)."""
        from transformers import DynamicCache

        layers = DynamicCache(config=self.model.config).layers
        if any(getattr(layer, "is_sliding", False) for layer in layers):
            log.warning("sliding-window attention: requests run one at a time")
            return 1
        return self.config.max_batch

    def generate(
        self, request: inference_service_pb2.GenerateRequest, sink: TextChunkSink | None = None
    ) -> inference_service_pb2.GenerateResponse:
        """Run ``request`` in the running batch (blocking until it is done)."""
        return self.submit(request, sink).result()

    def submit(
        self, request: inference_service_pb2.GenerateRequest, sink: TextChunkSink | None = None
    ) -> concurrent.futures.Future[inference_service_pb2.GenerateResponse]:
        """Queue ``request``; it joins the running batch within a few steps."""
        prompt_ids = [int(t) for t in self.tokenizer(request.prompt)["input_ids"]]
        job = Job(
            request=request,
            prompt_ids=prompt_ids,
            max_new_tokens=request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            sampling=resolve_sampling(request, self.model.generation_config),
            sink=sink,
        )
        return self.batcher().submit(job)

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        return self.generate(request)

    def warm_up(self) -> None:
        """Two tokens through the batcher (a prefill and a decode step), outside the worker's
        request accounting."""
        request = inference_service_pb2.GenerateRequest(
            request_id="omnistage-warm-up", prompt="warm up", max_new_tokens=2
        )
        started = time.monotonic()
        self.submit(request).result()
        log.info("warm-up: 2 tokens in %.3fs", time.monotonic() - started)

    def transient_bytes(self) -> int:
        return 0 if self._batcher is None else self._batcher.cache_bytes()

    def close(self) -> None:
        if self._batcher is not None:
            self._batcher.close()
        if self._encode_thread is not None:
            self._encode_thread.shutdown(wait=True)


def _eos_ids(model: Any, tokenizer: Any) -> set[int]:
    """The token ids that end generation (the generation config's, else the tokenizer's)."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        return set()
    return {int(e) for e in eos} if isinstance(eos, list | tuple) else {int(eos)}
