"""Transformers runner: a causal LM and its tokenizer from a local directory."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.worker.v1 import inference_service_pb2, types_pb2
from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import ChunkSink, TorchRunner, safetensors_in

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 32


class CausalLMRunner(TorchRunner):
    """Generate returns token ids and text; greedy unless ``do_sample`` (then seeded)."""

    runner_kind = types_pb2.RUNNER_AR
    backend_kind = types_pb2.BACKEND_TRANSFORMERS

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.model: Any = None
        self.tokenizer: Any = None

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.monotonic()
        self.resolve_dtype([self.model_dir], self._files())
        kwargs: dict[str, Any] = {"local_files_only": True, "dtype": self.dtype}
        if self.config.variant:
            kwargs["variant"] = self.config.variant
        self.model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), **kwargs)
        self.model.eval()
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        log.info(
            "loaded %s (%s) in %.2fs",
            type(self.model).__name__,
            self.model.dtype,
            time.monotonic() - started,
        )

    def modules(self) -> Mapping[str, torch.nn.Module]:
        return {"model": self.model}

    def _files(self) -> list[Path]:
        return safetensors_in(self.model_dir, self.config.variant)

    def weight_files(self) -> Mapping[str, Sequence[Path]] | None:
        found = self._files()
        return {"model": found} if found else None

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        started = time.monotonic()
        tok = self.tokenizer
        encoded = tok(request.prompt, return_tensors="pt")
        input_ids = encoded["input_ids"].to(self.device)
        attention_mask = encoded["attention_mask"].to(self.device)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        kwargs: dict[str, Any] = {
            "max_new_tokens": request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            "do_sample": request.do_sample,
            "pad_token_id": pad,
        }
        if not request.do_sample:
            # Greedy: sampling knobs from the model's generation config do not apply.
            kwargs.update(temperature=None, top_p=None, top_k=None)
        with torch.inference_mode():
            if request.do_sample:
                # transformers samples from the global generator; generate calls are serialized.
                torch.manual_seed(request.seed)
            if self.chunk_sink is not None:
                kwargs["streamer"] = TokenStreamer(tok, self.chunk_sink)
            output = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, **kwargs
            )
        new_ids = [int(t) for t in output[0, input_ids.shape[1] :].tolist()]
        text = tok.decode(new_ids, skip_special_tokens=True)
        response = inference_service_pb2.GenerateResponse(
            request_id=request.request_id,
            text=inference_service_pb2.TextOutput(token_ids=new_ids, text=text),
        )
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response


class TokenStreamer:
    """A transformers streamer that hands each new token and its text to a sink.

    ``generate`` first puts the prompt (skipped), then each generated token. Text is decoded
    over all tokens so far and only the new suffix is sent; a trailing replacement character
    (a multi-byte character not complete yet) waits for the next token.
    """

    def __init__(self, tokenizer: Any, sink: ChunkSink) -> None:
        self._tokenizer = tokenizer
        self._sink = sink
        self._prompt_seen = False
        self._ids: list[int] = []
        self._sent = ""

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        new = [int(t) for t in value.reshape(-1).tolist()]
        self._ids.extend(new)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        delta = ""
        if not text.endswith("\ufffd") and text.startswith(self._sent):
            delta, self._sent = text[len(self._sent) :], text
        self._sink(new, delta)

    def end(self) -> None:
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.startswith(self._sent) and len(text) > len(self._sent):
            self._sink([], text[len(self._sent) :])
            self._sent = text
