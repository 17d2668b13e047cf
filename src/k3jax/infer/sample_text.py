"""Text in, text out over the inference engine: the greedy sample the demo prints after training."""

from __future__ import annotations

from k3jax.infer.engine import Engine
from k3jax.nn.model import K3ForCausalLM


def greedy_sample(model: K3ForCausalLM, tokenizer, prompt: str, new_tokens: int = 200, chunk: int = 64,
                  engine: Engine | None = None, no_repeat_ngram: int = 0, stats: dict | None = None) -> str:
    """``prompt`` and its greedy continuation (chunked prefill, cached decode; BOS first, EOS stops and is not
    shown). Pass an ``engine`` to reuse its compiled steps; ``no_repeat_ngram`` (see :meth:`Engine.generate`)
    guards against loops; ``stats`` (a dict) receives the engine's statistics."""
    ids = [tokenizer.bos_id] + tokenizer.encode(prompt)
    engine = engine if engine is not None else Engine(model, chunk=chunk)
    res = engine.generate([ids], new_tokens, stop_tokens=[tokenizer.eos_id], no_repeat_ngram=no_repeat_ngram)
    if stats is not None:
        stats.update(res.stats)
    out = res.tokens[0]
    return prompt + tokenizer.decode(out[:-1] if out and out[-1] == tokenizer.eos_id else out)


__all__ = ["greedy_sample"]
