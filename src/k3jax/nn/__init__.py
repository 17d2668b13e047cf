"""Flax NNX modules: own parameters, call :mod:`k3jax.ops`."""

from k3jax.nn.model import CausalLMOutput, K3ForCausalLM, K3Model

__all__ = ["CausalLMOutput", "K3ForCausalLM", "K3Model"]
