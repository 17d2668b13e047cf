"""Where a speculative round's drafts come from: the :class:`Proposer` interface the scheduler drafts through.

* :class:`PromptLookup` — host-side n-gram prompt lookup over the request's prompt, its generated tokens and its
  predicted output (OpenAI's ``prediction``), incrementally (:class:`~k3jax.infer.speculative.NgramIndex`);
* :class:`FunctionProposer` — any host function ``(request, n) → ids`` (tools, tests);
* :class:`DraftModel` — a small model with the target's tokenizer, run by the model runner on the device inside the
  round (its drafts never reach the host); the scheduler only keeps it caught up with the target's tokens.
"""

from __future__ import annotations

from typing import Callable, Sequence

from k3jax.infer.requests import Request
from k3jax.infer.speculative import NgramIndex, SpecConfig


class Proposer:
    """Drafts for one request. ``on_device``: the runner makes the drafts in the round (``propose`` is not called);
    otherwise :meth:`propose` returns up to ``n`` token ids from the host."""

    on_device = False

    def propose(self, req: Request, n: int) -> list[int]:
        raise TypeError(f"{type(self).__name__} makes its drafts on the device")


class PromptLookup(Proposer):
    """vLLM's ``ngram`` method: the tokens that followed the latest earlier occurrence of the sequence's last n tokens
    (n from ``max_n`` down to ``min_n``), in the prompt, the generated text or the request's predicted output. The
    request's index (``req.spec.ngram``) grows by the tokens added since the last call."""

    def __init__(self, min_n: int = 2, max_n: int = 4):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, req: Request, n: int) -> list[int]:
        st = req.spec
        if st.ngram is None:
            st.ngram = NgramIndex(self.min_n, self.max_n, st.prediction, len(req.prompt))
        have, P = len(st.ngram.tokens), len(req.prompt)
        if have < P:
            st.ngram.extend(req.prompt[have:])
        st.ngram.extend(req.tokens[max(0, have - P):])
        return st.ngram.propose(n)


class FunctionProposer(Proposer):
    """Drafts from ``fn(request, n)`` (at most ``n`` are used)."""

    def __init__(self, fn: Callable[[Request, int], Sequence[int]]):
        self.fn = fn

    def propose(self, req: Request, n: int) -> list[int]:
        return [int(t) for t in self.fn(req, n)][:n]


class DraftModel(Proposer):
    """A draft model (a :class:`~k3jax.nn.model.K3ForCausalLM` sharing the target's vocabulary), run on the device."""

    on_device = True

    def __init__(self, model, name: str = "draft"):
        self.model, self.name = model, name


def make_proposer(spec: SpecConfig, draft_model=None) -> Proposer:
    """The proposer a :class:`SpecConfig` names (``draft_model``: a loaded draft instead of loading ``spec.draft``)."""
    if spec.method == "ngram":
        return PromptLookup(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if draft_model is None:
        from k3jax.infer.load import load_model

        draft_model, _, _ = load_model(spec.draft)
    return DraftModel(draft_model, spec.draft)


__all__ = ["Proposer", "PromptLookup", "FunctionProposer", "DraftModel", "make_proposer"]
