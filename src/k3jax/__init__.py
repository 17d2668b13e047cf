"""k3jax: the Kimi K3 language-model architecture in JAX."""

from k3jax.parallel.host import guard_collective_threads

# XLA_FLAGS forcing several host CPU devices: give XLA the threads their collectives need before its CPU backend
# starts (with as many threads as devices, a multi-device program can deadlock; k3jax.parallel.host)
guard_collective_threads()

from k3jax.config import ConfigError, K3Config, LinearAttnConfig, preset_names
from k3jax.nn.model import CausalLMOutput, K3ForCausalLM

__all__ = ["ConfigError", "K3Config", "LinearAttnConfig", "preset_names", "CausalLMOutput", "K3ForCausalLM",
           "load_pretrained", "save_pretrained", "generate"]
__version__ = "0.1.0"


def load_pretrained(path, **kw):
    """Load a K3 release or Kimi Linear checkpoint directory (see :func:`k3jax.io.hf.load_pretrained`)."""
    from k3jax.io.hf import load_pretrained as _load

    return _load(path, **kw)


def save_pretrained(model, path, **kw):
    """Write the release checkpoint format (see :func:`k3jax.io.export.save_pretrained`)."""
    from k3jax.io.export import save_pretrained as _save

    return _save(model, path, **kw)


def generate(model, prompt_ids, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=0, **kw):
    """Generated token ids for ``prompt_ids`` (one list of ids, or a list of them); greedy when temperature is 0.
    See :func:`k3jax.infer.engine.generate` (stop tokens, prefill chunk)."""
    from k3jax.infer.engine import generate as _generate

    return _generate(model, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, **kw)
