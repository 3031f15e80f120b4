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
from omnistage_worker.engine.placement import Block, blocks_of
from omnistage_worker.runners.base import ChunkSink, TorchRunner, safetensors_in

log = logging.getLogger(__name__)

DEFAULT_MAX_NEW_TOKENS = 32


class CausalLMRunner(TorchRunner):
    """Generate returns token ids and text; greedy unless sampling (then seeded)."""

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

    def blocks(self) -> list[Block]:
        """Decoder layers (the model's ``_no_split_modules``) and the modules around them."""
        no_split = getattr(self.model, "_no_split_modules", None) or []
        return blocks_of(self.modules(), no_split=no_split)

    def _files(self) -> list[Path]:
        return safetensors_in(self.model_dir, self.config.variant)

    def weight_files(self) -> Mapping[str, Sequence[Path]] | None:
        found = self._files()
        return {"model": found} if found else None

    def _generate(
        self, request: inference_service_pb2.GenerateRequest
    ) -> inference_service_pb2.GenerateResponse:
        """One request alone (unbatched): stop strings, per-request sampling and seed, log
        probabilities from the raw logits, usage and the finish reason (see the proto)."""
        started = time.monotonic()
        tok = self.tokenizer
        encoded = tok(request.prompt, return_tensors="pt")
        input_ids = encoded["input_ids"].to(self.device)
        attention_mask = encoded["attention_mask"].to(self.device)
        prompt_len = int(input_ids.shape[1])
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        max_new = request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        stops = list(request.stop)
        kwargs: dict[str, Any] = {"max_new_tokens": max_new, "pad_token_id": pad}
        kwargs.update(sampling_kwargs(request))
        if stops:
            from transformers import StoppingCriteriaList

            kwargs["stopping_criteria"] = StoppingCriteriaList([StopText(tok, stops, prompt_len)])
        want_logprobs = request.HasField("top_logprobs")
        if want_logprobs:
            kwargs.update(return_dict_in_generate=True, output_logits=True)
        with torch.inference_mode():
            if kwargs["do_sample"]:
                # transformers samples from the global generator; generate calls are serialized.
                torch.manual_seed(request.seed)
            if self.chunk_sink is not None:
                kwargs["streamer"] = TokenStreamer(tok, self.chunk_sink, stops)
            output = self.model.generate(
                input_ids=input_ids, attention_mask=attention_mask, **kwargs
            )
        sequences = output.sequences if want_logprobs else output
        new_ids = [int(t) for t in sequences[0, prompt_len:].tolist()]
        text = tok.decode(new_ids, skip_special_tokens=True)
        cut = cut_at_stop(text, stops)
        stopped = cut is not None or (bool(new_ids) and new_ids[-1] == tok.eos_token_id)
        reason = (
            inference_service_pb2.FINISH_REASON_LENGTH
            if len(new_ids) >= max_new and not stopped
            else inference_service_pb2.FINISH_REASON_STOP
        )
        out = inference_service_pb2.TextOutput(
            token_ids=new_ids, text=text if cut is None else cut, finish_reason=reason
        )
        if want_logprobs:
            out.logprobs.extend(token_logprobs(tok, output.logits, new_ids, request.top_logprobs))
        response = inference_service_pb2.GenerateResponse(
            request_id=request.request_id,
            text=out,
            usage=inference_service_pb2.Usage(
                prompt_tokens=prompt_len, completion_tokens=len(new_ids)
            ),
            batch_size=1,
        )
        response.duration.FromNanoseconds(int((time.monotonic() - started) * 1e9))
        return response


def sampling_kwargs(request: inference_service_pb2.GenerateRequest) -> dict[str, Any]:
    """generate's sampling arguments: temperature unset keeps ``do_sample``; 0 is greedy."""
    sampled = request.HasField("temperature")
    do_sample = request.temperature > 0 if sampled else request.do_sample
    if not do_sample:
        # Greedy: sampling knobs from the model's generation config do not apply.
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    kwargs: dict[str, Any] = {"do_sample": True}
    if request.HasField("temperature"):
        kwargs["temperature"] = request.temperature
    if request.HasField("top_p"):
        kwargs["top_p"] = request.top_p
    return kwargs


def cut_at_stop(text: str, stops: Sequence[str]) -> str | None:
    """``text`` cut before its first stop string (None: no stop string in it)."""
    found = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[: min(found)] if found else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of ``text`` could still begin a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


def token_logprobs(
    tok: Any, logits: Sequence[torch.Tensor], ids: Sequence[int], top: int
) -> list[inference_service_pb2.TokenLogprob]:
    """Per generated token: its log probability under the raw logits and the ``top`` best."""
    entries = []
    for step, token_id in enumerate(ids):
        logprobs = torch.log_softmax(logits[step][0].float(), dim=-1)
        entry = inference_service_pb2.TokenLogprob(
            token_id=token_id,
            token=tok.decode([token_id]),
            logprob=float(logprobs[token_id]),
        )
        if top:
            values, indices = torch.topk(logprobs, min(top, logprobs.shape[-1]))
            for value, index in zip(values.tolist(), indices.tolist(), strict=True):
                entry.top.add(token_id=index, token=tok.decode([index]), logprob=value)
        entries.append(entry)
    return entries


class StopText:
    """A stopping criterion: the generated text (prompt excluded) contains a stop string."""

    def __init__(self, tokenizer: Any, stops: Sequence[str], prompt_len: int) -> None:
        self._tokenizer = tokenizer
        self._stops = list(stops)
        self._prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        text = self._tokenizer.decode(input_ids[0, self._prompt_len :], skip_special_tokens=True)
        done = cut_at_stop(text, self._stops) is not None
        return torch.full((input_ids.shape[0],), done, dtype=torch.bool, device=input_ids.device)


class TokenStreamer:
    """A transformers streamer that hands each new token and its text to a sink.

    ``generate`` first puts the prompt (skipped), then each generated token. Text is decoded
    over all tokens so far and only the new suffix is sent; a trailing replacement character
    (a multi-byte character not complete yet) waits for the next token.
    """

    def __init__(self, tokenizer: Any, sink: ChunkSink, stops: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._sink = sink
        self._stops = list(stops)
        self._prompt_seen = False
        self._ids: list[int] = []
        self._sent = ""

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        new = [int(t) for t in value.reshape(-1).tolist()]
        self._ids.extend(new)
        text = self._visible(self._tokenizer.decode(self._ids, skip_special_tokens=True))
        delta = ""
        if not text.endswith("\ufffd") and text.startswith(self._sent):
            delta, self._sent = text[len(self._sent) :], text
        self._sink(new, delta)

    def _visible(self, text: str, final: bool = False) -> str:
        """The text that may be sent: cut at a stop string, less a possible stop's start."""
        cut = cut_at_stop(text, self._stops)
        if cut is not None:
            return cut
        return text if final else text[: len(text) - held_back(text, self._stops)]

    def end(self) -> None:
        text = self._visible(self._tokenizer.decode(self._ids, skip_special_tokens=True), True)
        if text.startswith(self._sent) and len(text) > len(self._sent):
            self._sink([], text[len(self._sent) :])
            self._sent = text
