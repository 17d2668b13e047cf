"""Inference: caches, the prefill/decode engine, sampling, tokenizers."""

from k3jax.infer.engine import Engine, GenerateResult, GenerationError, generate

__all__ = ["Engine", "GenerateResult", "GenerationError", "generate"]
