"""STAND-IN of ``vllm.entrypoints.openai.completion.protocol``: its request model's fields.

The names are vLLM 0.24's (its
``CompletionRequest`` defines these top-level fields and serves a
request without any other); the stand-in keeps only the names, which is what the worker reads.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    add_special_tokens: Any = None
    allowed_token_ids: Any = None
    cache_salt: Any = None
    echo: Any = None
    frequency_penalty: Any = None
    ignore_eos: Any = None
    include_stop_str_in_output: Any = None
    kv_transfer_params: Any = None
    length_penalty: Any = None
    logit_bias: Any = None
    logprobs: Any = None
    max_tokens: Any = None
    min_p: Any = None
    min_tokens: Any = None
    model: Any = None
    n: Any = None
    presence_penalty: Any = None
    priority: Any = None
    prompt: Any = None
    prompt_embeds: Any = None
    prompt_logprobs: Any = None
    repetition_detection: Any = None
    repetition_penalty: Any = None
    request_id: Any = None
    response_format: Any = None
    return_token_ids: Any = None
    return_tokens_as_token_ids: Any = None
    seed: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    stop: Any = None
    stop_token_ids: Any = None
    stream: Any = None
    stream_options: Any = None
    structured_outputs: Any = None
    suffix: Any = None
    temperature: Any = None
    thinking_token_budget: Any = None
    top_k: Any = None
    top_p: Any = None
    truncate_prompt_tokens: Any = None
    truncation_side: Any = None
    use_beam_search: Any = None
    user: Any = None
    vllm_xargs: Any = None
