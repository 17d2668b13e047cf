"""Inference: the prefill/decode engine, the continuous-batching scheduler behind ``k3jax serve``
(``infer.scheduler``), sampling, loading a model for it (``infer.load``) and text sampling (``infer.sample_text``).
Tokenizers are :mod:`k3jax.text.tokenizer`, shared with training."""

from k3jax.infer.engine import Engine, GenerateResult, GenerationError, generate
from k3jax.infer.scheduler import QueueFull, Request, RequestError, SamplingParams, Scheduler, TokenEvent

__all__ = ["Engine", "GenerateResult", "GenerationError", "generate", "Scheduler", "SamplingParams", "Request",
           "TokenEvent", "RequestError", "QueueFull"]
