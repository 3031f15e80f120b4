"""A STAND-IN for vLLM, for CI only (never part of the product; CI has no vLLM and no GPU).

``tests/fakevllm/vllm`` is importable as ``vllm`` only when a test puts ``tests/fakevllm`` on a
stage's ``PYTHONPATH``. It offers the part of vLLM 0.24's ``LLM`` the worker calls
(``LLM(..., enable_sleep_mode=True)``, ``sleep(level)``, ``wake_up(tags=...)``,
``collective_rpc("reload_weights")``, ``generate`` with ``prompt_token_ids``, ``SamplingParams``)
with real memory physics on the simulated GPU (:mod:`tests.fakegpu`): its engine runs in a child
process (as vLLM's engine core does) that takes its context, the weights and a KV cache of
``gpu_memory_utilization`` at start, and holds only its context (plus CUDA graphs unless
``enforce_eager``) asleep. See :mod:`tests.fakevllm.vllm.engine_core` for the physics.
"""
