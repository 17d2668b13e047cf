"""Inference: the prefill/decode engine, sampling, loading a model for it (``infer.load``) and text sampling
(``infer.sample_text``). Tokenizers are :mod:`k3jax.text.tokenizer`, shared with training."""

from k3jax.infer.engine import Engine, GenerateResult, GenerationError, generate

__all__ = ["Engine", "GenerateResult", "GenerationError", "generate"]
