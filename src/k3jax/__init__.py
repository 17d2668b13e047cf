"""k3jax: the Kimi K3 language-model architecture in JAX."""

from k3jax.config import ConfigError, K3Config, LinearAttnConfig, preset_names
from k3jax.nn.model import CausalLMOutput, K3ForCausalLM

__all__ = ["ConfigError", "K3Config", "LinearAttnConfig", "preset_names", "CausalLMOutput", "K3ForCausalLM",
           "load_pretrained"]
__version__ = "0.1.0"


def load_pretrained(path, **kw):
    """Load a K3 release or Kimi Linear checkpoint directory (``config.json`` + safetensors) → model."""
    from k3jax.io.hf import load_pretrained as _load

    return _load(path, **kw)
