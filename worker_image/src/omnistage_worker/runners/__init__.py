"""Model runners: load a model from a local directory, serve Generate, expose weights to sleep."""

from __future__ import annotations

from omnistage_worker.config import WorkerConfig
from omnistage_worker.runners.base import ModelRunner


def create_runner(config: WorkerConfig) -> ModelRunner:
    """The runner for the configured runner/backend; heavy libraries are imported only here."""
    if config.backend == "diffusers":
        from omnistage_worker.runners.diffusion import DiffusionRunner

        return DiffusionRunner(config)
    if config.backend == "transformers":
        from omnistage_worker.runners.causal_lm import CausalLMRunner

        return CausalLMRunner(config)
    if config.backend == "vllm":
        from omnistage_worker.runners.vllm import VllmRunner

        return VllmRunner(config)
    raise ValueError(f"unknown backend {config.backend!r}")
