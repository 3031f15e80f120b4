"""A gRPC GenerateRequest as vLLM sampling parameters, and vLLM's output as the response.

The worker's request semantics (``inference_service.proto``) on vLLM's: ``temperature`` unset
means ``do_sample`` (1.0, seeded by ``seed``) or greedy; ``stop`` strings are vLLM's (the text
is cut before the stop string), which needs a tokenizer; ``top_logprobs`` is vLLM's
``logprobs`` (it returns the sampled token and the top alternatives from the raw distribution).
"""

from __future__ import annotations

from typing import Any

from omnistage.worker.v1 import inference_service_pb2
from omnistage_worker.runners.base import InvalidRequest

DEFAULT_MAX_NEW_TOKENS = 32
MAX_TOP_LOGPROBS = 20


def sampling_kwargs(
    request: inference_service_pb2.GenerateRequest, tokenizer: bool
) -> dict[str, Any]:
    """``vllm.SamplingParams``' arguments for ``request`` (InvalidRequest naming a field)."""
    if request.HasField("temperature"):
        temperature = float(request.temperature)
        if not temperature >= 0:
            raise InvalidRequest("temperature", f"{temperature} must be >= 0")
    else:
        temperature = 1.0 if request.do_sample else 0.0
    kwargs: dict[str, Any] = {
        "max_tokens": request.max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
        "temperature": temperature,
        "seed": int(request.seed) if temperature > 0 else None,
        "detokenize": tokenizer,
    }
    if request.HasField("top_p"):
        if not 0 < request.top_p <= 1:
            raise InvalidRequest("top_p", f"{request.top_p} must be in (0, 1]")
        kwargs["top_p"] = float(request.top_p)
    if request.stop:
        if not tokenizer:
            raise InvalidRequest("stop", "stop strings need a tokenizer; this model has none")
        kwargs["stop"] = list(request.stop)
    if request.HasField("top_logprobs"):
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest("top_logprobs", f"{request.top_logprobs} (0 to 20)")
        kwargs["logprobs"] = int(request.top_logprobs)
    return kwargs


def token_logprobs(
    token_ids: list[int], logprobs: Any, top: int
) -> list[inference_service_pb2.TokenLogprob]:
    """vLLM's per-token ``{token_id: Logprob}`` as TokenLogprob (the sampled token, top ``top``)."""
    out = []
    for token_id, entry in zip(token_ids, logprobs or [], strict=False):
        chosen = entry[token_id]
        ranked = sorted(entry.items(), key=lambda kv: kv[1].rank or 0)[:top]
        out.append(
            inference_service_pb2.TokenLogprob(
                token_id=token_id,
                token=chosen.decoded_token or "",
                logprob=float(chosen.logprob),
                top=[
                    inference_service_pb2.TopLogprob(
                        token_id=tid, token=lp.decoded_token or "", logprob=float(lp.logprob)
                    )
                    for tid, lp in ranked
                ],
            )
        )
    return out


def finish_reason(reason: str | None) -> inference_service_pb2.FinishReason.ValueType:
    if reason == "length":
        return inference_service_pb2.FINISH_REASON_LENGTH
    return inference_service_pb2.FINISH_REASON_STOP


def response_of(
    request: inference_service_pb2.GenerateRequest, final: Any, batch_size: int
) -> inference_service_pb2.GenerateResponse:
    """The GenerateResponse of vLLM's final ``RequestOutput`` for ``request``."""
    completion = final.outputs[0]
    ids = [int(t) for t in completion.token_ids]
    text = inference_service_pb2.TextOutput(
        token_ids=ids,
        text=completion.text or "",
        finish_reason=finish_reason(completion.finish_reason),
    )
    if request.HasField("top_logprobs"):
        text.logprobs.extend(token_logprobs(ids, completion.logprobs, request.top_logprobs))
    return inference_service_pb2.GenerateResponse(
        request_id=request.request_id,
        text=text,
        usage=inference_service_pb2.Usage(
            prompt_tokens=len(final.prompt_token_ids or []), completion_tokens=len(ids)
        ),
        batch_size=batch_size,
    )
