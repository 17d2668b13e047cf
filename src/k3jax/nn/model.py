"""Decoder layer, Block AttnRes stream (spec §2, §6) and the causal LM — one forward for training, prefill and
decode: without a cache it runs whole sequences; with a :class:`~k3jax.nn.cache.Cache` it continues them."""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from k3jax.config import K3Config
from k3jax.nn.cache import Cache, LayerCache, PagedMLACache
from k3jax.nn.kda import KDAttention
from k3jax.nn.layers import KeyGen, Proj, RMSNorm, TokenGroups, param
from k3jax.nn.mla import MLAttention
from k3jax.nn.moe import MLP, MoE, RoutingStats
from k3jax.nn.pipeline import run_pipelined
from k3jax.nn.remat import RematPolicy, remat_policy
from k3jax.nn.scan import BlockBuffer, RunLayout, run_scanned, scan_plan, stack_layers, unstack_run
from k3jax.ops.attnres import attnres_mix
from k3jax.ops.norm import rms_norm
from k3jax.parallel.context import ContextParallel
from k3jax.parallel.ep import ExpertParallel


class AttnResSite(nnx.Module):
    """One AttnRes read: the norm gain ``{site}_norm.weight [H]`` and pseudo-query ``{site}_proj.weight [1, H]``.

    The pseudo-query starts at zero, so every read starts as a uniform average of its candidates.
    """

    def __init__(self, cfg: K3Config):
        dt = jnp.dtype(cfg.dtype)
        self.eps = cfg.rms_norm_eps
        self.norm = param(jnp.ones((cfg.hidden_size,), dt), (None,))
        self.proj = param(jnp.zeros((1, cfg.hidden_size), dt), (None, None))

    def __call__(self, blocks: list[jax.Array], partial: jax.Array, recompute: bool = False,
                 norm: RMSNorm | None = None) -> jax.Array:
        """The read of ``blocks`` and ``partial``, then ``norm`` when given (the layer norm the read feeds).
        ``recompute``: the backward keeps only the read's inputs — the shared blocks and the partial sum, what a
        plain residual layer keeps as its norm's input — and recomputes the stacked candidates, scores, weights,
        the read and the norm's input from them (:mod:`k3jax.nn.remat`)."""
        eps, norm_eps = self.eps, None if norm is None else norm.eps

        def read(blocks, partial, gain, query, norm_weight):
            if isinstance(blocks, BlockBuffer):                          # a scanned run's blocks (masked rows)
                rows, valid = blocks.candidates()
                a = attnres_mix(rows, partial, gain, query, eps, valid=valid)
            else:
                a = attnres_mix(blocks, partial, gain, query, eps)
            return a if norm_weight is None else rms_norm(a, norm_weight, norm_eps)

        if recompute and blocks:
            read = jax.checkpoint(read)
        return read(blocks, partial, self.norm[...], self.proj[...], None if norm is None else norm.weight[...])


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: K3Config, idx: int, *, keys: KeyGen):
        dt = jnp.dtype(cfg.dtype)
        self.idx = idx
        self.kind = cfg.layer_types[idx]
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt)
        self.self_attn = KDAttention(cfg, keys=keys) if self.kind == "kda" else MLAttention(cfg, keys=keys)
        self.is_moe = cfg.is_moe_layer(idx)
        if self.is_moe:
            self.block_sparse_moe = MoE(cfg, keys=keys)
        else:
            self.mlp = MLP(cfg, cfg.hidden_size, cfg.intermediate_size, keys=keys)
        self.attn_res = cfg.attn_res
        if self.attn_res:
            self.block_size = cfg.attn_res_block_size
            self.self_attention_res = AttnResSite(cfg)
            self.mlp_res = AttnResSite(cfg)

    def __call__(self, x: jax.Array, blocks: list[jax.Array], *, cache: LayerCache | None = None,
                 pos: jax.Array | None = None, n_new: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, kda_kernel: str = "chunked", moe_grouped: bool = True,
                 ep: ExpertParallel | None = None, router_scores: bool = False, kda_record: bool = False,
                 cp: ContextParallel | None = None, attnres_recompute: bool = False, index: jax.Array | None = None
                 ) -> tuple[jax.Array, list[jax.Array], LayerCache | None, RoutingStats | None]:
        """Spec §2 steps 1–8: AttnRes reads (or a plain residual), attention, then the FFN.

        ``x`` is the running partial sum ``[B, T, hidden]``, ``blocks`` the sealed AttnRes blocks. With ``cache``
        the attention continues it (chunk at ``pos[b] + t``, first ``n_new[b]`` tokens real).
        ``attnres_recompute``: the AttnRes reads are recomputed in the backward (:mod:`k3jax.nn.remat`).
        ``index`` (traced; in a scanned run, :mod:`k3jax.nn.scan`, with ``blocks`` a ``BlockBuffer``): this
        layer's number, which decides whether it seals a block. Returns ``(partial sum, blocks, new layer cache or
        None, routing stats of a MoE layer or None)``."""
        def attend(h: jax.Array) -> tuple[jax.Array, LayerCache | None]:
            if self.kind == "kda":
                return self.self_attn(h, cache=cache, n_new=n_new, segment_ids=segment_ids, kernel=kda_kernel,
                                      record=kda_record, cp=cp)
            return self.self_attn(h, cache=cache, pos=pos, n_new=n_new, segment_ids=segment_ids, cp=cp)

        return self.stream(x, blocks, attend, moe_grouped=moe_grouped, ep=ep, router_scores=router_scores,
                           recompute=attnres_recompute, index=index)

    def stream(self, x: jax.Array, blocks: list[jax.Array], attend, *, moe_grouped: bool = True,
               ep: ExpertParallel | None = None, router_scores: bool = False, recompute: bool = False,
               index: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array], object, RoutingStats | None]:
        """The layer around its sequence mixer: ``attend(h)`` → ``(y, cache)`` with ``h = input_norm(a)`` the
        normed AttnRes read (or the residual) ``[.., T, hidden]``; then the FFN read, the FFN and the partial sum.
        ``recompute``: the AttnRes reads are recomputed in the backward. The mixer's and the FFN's inputs and
        outputs carry the names :data:`k3jax.nn.remat.LAYER_NAMES`. Returns ``(partial sum, blocks, what attend
        returned as its cache, routing stats or None)``."""
        def mixer(h: jax.Array) -> tuple[jax.Array, object]:
            y, cache = attend(checkpoint_name(h, "mixer_in"))
            return checkpoint_name(y, "mixer_out"), cache

        def ffn(h: jax.Array) -> tuple[jax.Array, RoutingStats | None]:
            h = checkpoint_name(h, "ffn_in")
            if self.is_moe:
                f, stats = self.block_sparse_moe(h, grouped=moe_grouped, ep=ep, router_scores=router_scores)
            else:
                f, stats = self.mlp(h), None
            return checkpoint_name(f, "ffn_out"), stats

        if not self.attn_res:
            y, cache = mixer(self.input_layernorm(x))
            x = x + y
            f, stats = ffn(self.post_attention_layernorm(x))
            return x + f, blocks, cache, stats
        p = x
        if blocks:
            h = self.self_attention_res(blocks, p, recompute, norm=self.input_layernorm)
        else:
            h = self.input_layernorm(p)                                  # the read is the identity only at layer 0
        if isinstance(blocks, BlockBuffer):                              # scanned: the seal decided at run time
            sealed = index % self.block_size == 0
            blocks = blocks.seal(p, sealed)
            y, cache = mixer(h)
            p = jnp.where(sealed, y, p + y)
        else:
            sealed = self.idx % self.block_size == 0
            if sealed:                                                   # seal after the read, before attention
                blocks = blocks + [p]
            y, cache = mixer(h)
            p = y if sealed else p + y                                   # the partial sum restarts after a seal
        f, stats = ffn(self.mlp_res(blocks, p, recompute, norm=self.post_attention_layernorm))
        return p + f, blocks, cache, stats

    def forward_groups(self, x: jax.Array, blocks: list[jax.Array], groups: TokenGroups, caches: tuple,
                       pos: tuple[jax.Array, ...], n_new: tuple[jax.Array, ...], record: tuple[bool, ...]
                       ) -> tuple[jax.Array, list[jax.Array], tuple]:
        """:meth:`__call__` over several row groups at once: ``x [1, N, hidden]`` and ``blocks`` hold every group's
        tokens (:class:`TokenGroups`); group g continues ``caches[g]`` at ``pos[g] [B_g]`` with ``n_new[g]``
        (``record[g]``: a KDA layer returns :class:`~k3jax.nn.cache.KDAPending`). Norms, AttnRes reads and the FFN
        run on all N tokens. Returns ``(partial sum, blocks, the groups' new layer caches)``."""
        x, blocks, caches, _ = self.stream(x, blocks, functools.partial(self.attend_groups, groups, caches, pos,
                                                                        n_new, record))
        return x, blocks, caches

    def attend_groups(self, groups: TokenGroups, caches: tuple, pos: tuple, n_new: tuple, record: tuple,
                      h: jax.Array) -> tuple[jax.Array, tuple]:
        """The sequence mixer over every group's tokens ``h [1, N, hidden]``: ``(y, the groups' new caches)``."""
        if self.kind == "kda":
            return self.self_attn.forward_groups(h, groups, caches, n_new, record)
        return self.self_attn.forward_groups(h, groups, caches, pos, n_new)


def _checkpointed(layer: DecoderLayer, x: jax.Array, blocks: list[jax.Array], policy: RematPolicy, kw: dict
                  ) -> tuple[jax.Array, list[jax.Array], RoutingStats | None]:
    """One decoder layer (whole sequences, no cache) under ``jax.checkpoint`` with ``policy.layer``: the backward
    recomputes what the policy does not save from the layer's inputs (``x`` and the shared ``blocks``). The
    layer's state goes in as a pure argument (a forward mutates none of it)."""
    graph, state = nnx.split(layer)

    def run(state, x, blocks):
        x, blocks, _, st = nnx.merge(graph, state)(x, blocks, attnres_recompute=policy.attnres, **kw)
        return x, blocks, st

    return jax.checkpoint(run, policy=policy.layer)(state, x, blocks)


class CausalLMOutput(NamedTuple):
    logits: jax.Array                     # [B, T, vocab]
    expert_counts: jax.Array              # [n_moe_layers, num_experts] int32 (tokens routed to each expert)
    cache: Cache | None = None            # the continued cache, when one was passed
    router_scores: tuple | None = None    # per MoE layer [B·T, E] fp32 (no gradient), with router_scores=True


class K3Model(nnx.Module):
    """Embedding → decoder layers (KDA/MLA × dense/MoE, AttnRes stream) → output read → final norm.

    Storage: the periodic run of layers (:func:`k3jax.nn.scan.scan_plan`) is ``run[p]``, one decoder layer per
    period position whose variables are stacked ``[repeats, ...]``; ``layers[i]`` holds the layers outside it
    (None inside). :meth:`layer_views` / :meth:`K3ForCausalLM.layer` give every layer as a module."""

    def __init__(self, cfg: K3Config, *, keys: KeyGen):
        dt = jnp.dtype(cfg.dtype)
        self.embed_tokens = param(
            (cfg.initializer_range * jax.random.normal(keys(), (cfg.vocab_size, cfg.hidden_size),
                                                       jnp.float32)).astype(dt), ("vocab", "embed"))
        layers = [DecoderLayer(cfg, i, keys=keys) for i in range(cfg.num_hidden_layers)]
        self.scan_plan = plan = scan_plan(cfg)           # the periodic run, stored stacked (k3jax.nn.scan)
        self.n_layers = len(layers)
        if plan is not None:                             # layers start … stop − 1: P stacked modules [repeats, ...]
            self.run = nnx.List(stack_layers(layers, plan))
            layers = [None if plan.start <= i < plan.stop else l for i, l in enumerate(layers)]
        self.layers = nnx.List(layers)                   # the layers outside the run (None inside it)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dt)
        self.attn_res = cfg.attn_res
        if self.attn_res:
            self.output_attn_res = AttnResSite(cfg)
        self.block_size = cfg.attn_res_block_size if cfg.attn_res else None

    def __call__(self, input_ids: jax.Array, *, cache: Cache | None = None, n_new: jax.Array | None = None,
                 embeds: tuple[jax.Array, jax.Array] | None = None, scan_layers: bool = False,
                 **kw) -> tuple[jax.Array, tuple | None, list[RoutingStats]]:
        """Final hidden states ``[B, T, hidden]``, the layers' new caches (or None) and the MoE layers' stats.
        ``embeds = (rows [B, T, hidden], mask [B, T] bool)``: where ``mask``, ``rows`` replace the token embedding
        (image features spliced at ``<|media_pad|>`` positions)."""
        policy = remat_policy(kw.pop("remat", None))
        if cache is not None:                            # continuing a cache: no backward to keep anything for
            policy = remat_policy("none")
        x = self.embed(input_ids, embeds)
        cp = kw.get("cp")
        if cp is not None and cp.active and cache is None:
            x = cp.constrain(x)                          # tokens stay on the rank that owns their time slice
        blocks: list[jax.Array] = []
        stats, new = [], []
        pipeline = kw.pop("pipeline", None)
        plan = self.scan_plan if scan_layers or pipeline is not None else None
        if pipeline is not None and (plan is None or cache is not None):
            raise ValueError("pipeline: needs a model with a periodic run of layers (k3jax.nn.scan.scan_plan) and "
                             "no cache")
        views = self.layer_views(plan is None)
        i = 0
        while i < self.n_layers:
            if pipeline is not None and i == plan.start:  # the periodic run over the stage axis
                rows = {k: kw[k] for k in ("segment_ids",) if kw.get(k) is not None}    # split per micro-batch
                x, blocks, sts = run_pipelined(
                    self.run, plan, self.block_size, x, blocks,
                    lambda r: functools.partial(self._one, policy, {**kw, **r}, None, None), pipeline, rows)
                stats += sts
                new += [None] * (plan.stop - i)
                i = plan.stop
                continue
            if plan is not None and i == plan.start:      # the periodic run: one scan body (k3jax.nn.scan)
                x, blocks, sts, cs = run_scanned(
                    self.run, plan, self.block_size, x, blocks, functools.partial(self._one, policy, kw, cache,
                                                                                     n_new),
                    recompute=policy.layer is not None or policy.attnres,
                    caches=None if cache is None else list(cache.layers[plan.start:plan.stop]))
                stats += sts
                new += cs if cache is not None else [None] * (plan.stop - i)
                i = plan.stop
                continue
            layer = views[i]
            if cache is None:
                x, blocks, st = self._whole(layer, x, blocks, policy, kw)
                c = None
            else:
                x, blocks, c, st = layer(x, blocks, cache=cache.layers[i], pos=cache.lengths, n_new=n_new, **kw)
            new.append(c)
            if st is not None:
                stats.append(st)
            i += 1
        return self.read_out(x, blocks, policy.attnres), (tuple(new) if cache is not None else None), stats

    @classmethod
    def _one(cls, policy: RematPolicy, kw: dict, cache: Cache | None, n_new, layer: DecoderLayer, x: jax.Array,
             blocks, index: jax.Array, c) -> tuple:
        """One layer of a scanned run: ``(x, blocks, new layer cache or None, stats or None)``."""
        if cache is None:
            x, blocks, st = cls._whole(layer, x, blocks, policy, kw, index)
            return x, blocks, None, st
        x, blocks, c, st = layer(x, blocks, cache=c, pos=cache.lengths, n_new=n_new, index=index, **kw)
        return x, blocks, c, st

    @staticmethod
    def _whole(layer: DecoderLayer, x: jax.Array, blocks, policy: RematPolicy, kw: dict,
               index: jax.Array | None = None) -> tuple[jax.Array, list[jax.Array], RoutingStats | None]:
        """One layer over whole sequences (no cache), checkpointed by ``policy``; ``index`` in a scanned run."""
        if policy.layer is not None:
            return _checkpointed(layer, x, blocks, policy, {**kw, "index": index})
        x, blocks, _, st = layer(x, blocks, attnres_recompute=policy.attnres, index=index, **kw)
        return x, blocks, st

    def layer_views(self, run_views: bool = True) -> list[DecoderLayer | None]:
        """Every layer as a module, in order: the stored ones outside the run, and (``run_views``) per-layer views
        of the run's stacks (:func:`k3jax.nn.scan.unstack_run`; copies — read them, write the stacks), else None."""
        out = list(self.layers)
        if self.scan_plan is not None and run_views:
            for i, layer in unstack_run(self.run, self.scan_plan).items():
                out[i] = layer
        return out

    def embed(self, input_ids: jax.Array, embeds: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
        """Token embeddings ``[.., T, hidden]``, ``rows`` where ``mask`` when ``embeds = (rows, mask)``."""
        x = jnp.take(self.embed_tokens[...], input_ids, axis=0)
        if embeds is not None:
            rows, mask = embeds
            x = jnp.where(mask[..., None], rows.astype(x.dtype), x)
        return x

    def read_out(self, x: jax.Array, blocks: list[jax.Array], recompute: bool = False) -> jax.Array:
        """The final hidden states: the output AttnRes read of the last partial sum ``x`` (or ``x``), normed."""
        if self.attn_res:
            return self.output_attn_res(blocks, x, recompute, norm=self.norm)
        return self.norm(x)

    def forward_groups(self, input_ids: tuple[jax.Array, ...], caches: tuple[Cache, ...],
                       n_new: tuple[jax.Array, ...], embeds: tuple, record: tuple[bool, ...],
                       scan_layers: bool = False) -> tuple[tuple[jax.Array, ...], tuple[tuple, ...]]:
        """Row groups ``input_ids[g] [B_g, T_g]`` continuing ``caches[g]`` in one pass: every token-wise step runs
        once on the groups' tokens concatenated (``[1, N, hidden]``, N = Σ B_g·T_g), the sequence mixing per group
        (:meth:`DecoderLayer.forward_groups`). ``embeds[g]``: None or ``(rows, mask)``. Returns the final hidden
        states ``[B_g, T_g, hidden]`` and the new layer caches, per group (inputs checked by the caller)."""
        groups = TokenGroups(ids.shape for ids in input_ids)
        flat_embeds = None
        if any(e is not None for e in embeds):
            H, dt = self.embed_tokens.shape[1], self.embed_tokens.dtype
            flat_embeds = (groups.join([jnp.zeros(ids.shape + (H,), dt) if e is None else e[0].astype(dt)
                                        for ids, e in zip(input_ids, embeds)]),
                           groups.join([jnp.zeros(ids.shape, bool) if e is None else e[1]
                                        for ids, e in zip(input_ids, embeds)]))
        x = self.embed(groups.join(input_ids), flat_embeds)                         # [1, N, hidden]
        pos = tuple(c.lengths for c in caches)
        blocks: list[jax.Array] = []
        per_layer: list[tuple] = []                     # per layer: the groups' new layer caches
        plan = self.scan_plan if scan_layers else None

        def one(layer, x, blocks, index, cs):
            x, blocks, cs, _ = layer.stream(x, blocks, functools.partial(layer.attend_groups, groups, cs, pos, n_new,
                                                                        record), index=index)
            return x, blocks, cs, None

        views = self.layer_views(plan is None)
        i = 0
        while i < self.n_layers:
            if plan is not None and i == plan.start:      # the periodic run: one scan body (k3jax.nn.scan)
                run = [tuple(c.layers[k] for c in caches) for k in range(plan.start, plan.stop)]
                x, blocks, _, cs = run_scanned(self.run, plan, self.block_size, x, blocks, one, caches=run)
                per_layer += cs
                i = plan.stop
                continue
            x, blocks, cs = views[i].forward_groups(x, blocks, groups, tuple(c.layers[i] for c in caches),
                                                          pos, n_new, record)
            per_layer.append(cs)
            i += 1
        new = tuple(tuple(cs[g] for cs in per_layer) for g in range(len(caches)))
        return tuple(groups.split(self.read_out(x, blocks))), new


class K3ForCausalLM(nnx.Module):
    """The K3 / Kimi Linear text model: ``model(input_ids [B, T] int32)`` → :class:`CausalLMOutput`."""

    def __init__(self, cfg: K3Config, *, rngs: nnx.Rngs | None = None):
        cfg.validate()
        keys = KeyGen(rngs.params() if rngs is not None else jax.random.key(0))
        self.config = cfg
        self.model = K3Model(cfg, keys=keys)
        if not cfg.tie_word_embeddings:
            self.lm_head = Proj(cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), muon=None,
                                dtype=jnp.dtype(cfg.dtype), init_std=cfg.initializer_range, keys=keys)

    def __call__(self, input_ids: jax.Array, *, cache: Cache | None = None, n_new: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, kda_kernel: str = "chunked", moe_grouped: bool = True,
                 ep: ExpertParallel | None = None, router_scores: bool = False,
                 kda_record: bool = False, cp: ContextParallel | None = None,
                 embeds: tuple[jax.Array, jax.Array] | None = None,
                 remat: str | RematPolicy | None = None, scan_layers: bool = False,
                 pipeline=None) -> CausalLMOutput:
        """Logits ``[B, T, vocab]`` and per-MoE-layer expert token counts.

        * ``cache=None``: whole sequences (training, one-shot scoring); ``segment_ids [B, T]`` marks packed
          documents.
        * ``cache`` (:func:`k3jax.nn.cache.init_cache`): continue each slot — the chunk sits at positions
          ``cache.lengths[b] + t`` and only its first ``n_new[b]`` tokens are real (default: all T); T = 1 is a
          decode step. ``out.cache`` is the updated cache (lengths advanced by ``n_new``).
        * ``ep``: routed experts over a mesh's expert axis (:class:`k3jax.parallel.ep.ExpertParallel`);
          ``kda_kernel="recurrent"`` / ``moe_grouped=False`` run the slow references;
          ``router_scores=True`` adds each MoE layer's router scores (what Quantile Balancing solves from).
        * ``kda_record=True`` (with ``cache``; speculative verification): ``out.cache`` is *pending* — each KDA
          layer a :class:`~k3jax.nn.cache.KDAPending` (state before the chunk + the chunk's per-token inputs), MLA
          layers with the chunk appended, lengths not advanced; ``out.cache.accept(n)`` keeps the first ``n[b]``
          tokens of each row.
        * ``cp`` (:class:`~k3jax.parallel.context.ContextParallel`, without a cache): sequences split along time
          over a mesh's context axis (KDA by affine state summaries, MLA by gathering the latent).
        * ``embeds = (rows [B, T, hidden], mask [B, T] bool)``: input rows that replace the token embedding where
          ``mask`` (image features at ``<|media_pad|>`` positions; :mod:`k3jax.vision`).
        * ``remat`` (without a cache): what each layer keeps for the backward, by name (:mod:`k3jax.nn.remat`:
          ``none`` | ``attnres`` | ``minimal`` | ``offload`` | ``full``); the forward's values do not change.
        * ``scan_layers`` (without a cache): the model's periodic run of layers (:mod:`k3jax.nn.scan`,
          ``self.model.scan_plan``) as one ``lax.scan`` body — compiled once instead of once per layer; the values
          equal the unrolled model's to fp32 rounding. With a cache the run's layer caches are stacked per
          period position inside the program (prefill, decode, verification alike).
        * ``pipeline`` (a :class:`k3jax.nn.pipeline.PipelineConfig`, without a cache): the periodic run split
          into stages over the mesh's ``stage`` axis, micro-batches in a GPipe schedule.
        """
        remat = remat_policy(remat)
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(f"input_ids: expected integer ids of shape [B, T], got {input_ids.dtype}{input_ids.shape}")
        if kda_record and cache is None:
            raise ValueError("kda_record: needs a cache (it verifies a continuation of each slot)")
        if cache is not None:
            if len(cache.layers) != self.model.n_layers:
                raise ValueError(f"cache: {len(cache.layers)} layer caches for a {self.model.n_layers}-layer model")
            if cache.batch != input_ids.shape[0]:
                raise ValueError(f"cache: batch {cache.batch} != input_ids batch {input_ids.shape[0]}")
            if n_new is None:
                n_new = jnp.full((input_ids.shape[0],), input_ids.shape[1], jnp.int32)
        if embeds is not None:
            rows, mask = embeds
            if rows.shape != input_ids.shape + (self.config.hidden_size,) or mask.shape != input_ids.shape:
                raise ValueError(f"embeds: expected rows {input_ids.shape + (self.config.hidden_size,)} and mask "
                                 f"{input_ids.shape}, got {rows.shape} and {mask.shape}")
        h, layers, stats = self.model(input_ids, cache=cache, n_new=n_new, segment_ids=segment_ids, embeds=embeds,
                                      kda_kernel=kda_kernel, moe_grouped=moe_grouped, ep=ep,
                                      router_scores=router_scores, kda_record=kda_record, cp=cp, remat=remat,
                                      scan_layers=scan_layers, **({} if pipeline is None else {"pipeline": pipeline}))
        E = self.config.num_experts or 0
        counts = jnp.stack([s.counts for s in stats]) if stats else jnp.zeros((0, E), jnp.int32)
        scores = tuple(s.scores for s in stats) if router_scores else None
        new_cache = None if cache is None else (Cache(tuple(layers), cache.lengths) if kda_record
                                                else cache.advance(layers, n_new))
        return CausalLMOutput(self.head(h), counts, new_cache, scores)

    def forward_groups(self, input_ids: tuple, caches: tuple, n_new: tuple, *, embeds: tuple | None = None,
                       kda_record: tuple | None = None, scan_layers: bool = False
                       ) -> tuple[tuple[jax.Array, ...], tuple[Cache, ...]]:
        """Several row groups of different shapes in one forward (one read of every weight): group g is
        ``input_ids[g] [B_g, T_g]`` continuing ``caches[g]`` (batch B_g, e.g. a ``read_slots`` view of a slot pool)
        with ``n_new[g] [B_g]`` real tokens per row — decode rows ``[b, 1]`` beside a prefill chunk ``[1, C]``,
        or verification rows ``[b, k+1]`` (``kda_record[g]`` True) beside one.

        Group g gets what ``model(input_ids[g], cache=caches[g], n_new=n_new[g], embeds=embeds[g],
        kda_record=kda_record[g])`` computes: every token-wise step runs once on all Σ B_g·T_g tokens, the KDA
        recurrence and MLA attention per group. ``embeds[g]``: None or ``(rows [B_g, T_g, hidden], mask [B_g,
        T_g])``. Paged MLA caches share one page pool: every returned cache carries the pool with all groups'
        tokens, so writing them back (``Cache.write_slots``) in any order keeps every group's appends.

        Returns ``(hidden, caches)``: the final (normed) hidden states ``[B_g, T_g, hidden]`` per group (logits:
        :meth:`head` of the rows wanted) and the per-group caches (lengths advanced by ``n_new[g]``, or pending for
        a recording group). ``scan_layers``: the periodic run of layers as one scan body, as in :meth:`__call__`
        (the run's layer caches stacked per period position inside the program).
        """
        input_ids, caches, n_new, embeds, record = self._check_groups(input_ids, caches, n_new, embeds, kda_record)
        hidden, layers = self.model.forward_groups(input_ids, caches, n_new, embeds, record, scan_layers)
        new = tuple(Cache(ls, c.lengths) if r else c.advance(ls, n)
                    for ls, c, n, r in zip(layers, caches, n_new, record))
        return hidden, new

    def _check_groups(self, input_ids, caches, n_new, embeds, kda_record) -> tuple[tuple, ...]:
        """:meth:`forward_groups`' inputs as tuples of one entry per group (ids and ``n_new`` as arrays, ``embeds``
        and ``kda_record`` filled in), or a ValueError naming the argument."""
        G = len(input_ids)
        if G == 0:
            raise ValueError("input_ids: expected at least one group")
        embeds = (None,) * G if embeds is None else tuple(embeds)
        record = (False,) * G if kda_record is None else tuple(bool(r) for r in kda_record)
        for name, v in (("caches", caches), ("n_new", n_new), ("embeds", embeds), ("kda_record", record)):
            if len(v) != G:
                raise ValueError(f"{name}: {len(v)} groups, input_ids has {G}")
        ids, nn, L, H = [], [], self.model.n_layers, self.config.hidden_size
        for g, (x, c, n, e) in enumerate(zip(input_ids, caches, n_new, embeds)):
            x, n = jnp.asarray(x), jnp.asarray(n)
            if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
                raise ValueError(f"input_ids[{g}]: expected integer ids of shape [B, T], got {x.dtype}{x.shape}")
            if x.size == 0:
                raise ValueError(f"input_ids[{g}]: an empty group {x.shape}")
            if not isinstance(c, Cache) or len(c.layers) != L:
                raise ValueError(f"caches[{g}]: expected a Cache with {L} layer caches")
            if c.batch != x.shape[0]:
                raise ValueError(f"caches[{g}]: batch {c.batch} != input_ids[{g}] batch {x.shape[0]}")
            if n.shape != (x.shape[0],) or not jnp.issubdtype(n.dtype, jnp.integer):
                raise ValueError(f"n_new[{g}]: expected integers of shape ({x.shape[0]},), got {n.dtype}{n.shape}")
            if e is not None and (e[0].shape != x.shape + (H,) or e[1].shape != x.shape):
                raise ValueError(f"embeds[{g}]: expected rows {x.shape + (H,)} and mask {x.shape}, got "
                                 f"{e[0].shape} and {e[1].shape}")
            ids.append(x)
            nn.append(n)
        for i in range(L):
            kinds = [type(c.layers[i]) for c in caches]
            if PagedMLACache in kinds and any(k is not PagedMLACache for k in kinds):
                raise ValueError(f"caches: layer {i} is paged in some groups and not in others (one slot pool)")
            pools = {tuple(x.shape for x in c.layers[i].pool) for c in caches if kinds[0] is PagedMLACache}
            if len(pools) > 1:
                raise ValueError(f"caches: layer {i}'s page pools differ in shape across groups {sorted(pools)}")
        return tuple(ids), tuple(caches), tuple(nn), embeds, record

    def head(self, h: jax.Array) -> jax.Array:
        """Logits ``[..., vocab]`` from final hidden states."""
        if self.config.tie_word_embeddings:
            return jnp.einsum("...d,vd->...v", h, self.model.embed_tokens[...].astype(h.dtype))
        return self.lm_head(h)

    def layer(self, i: int) -> DecoderLayer:
        """Decoder layer ``i`` (0 … n − 1): the stored module, or for a layer of the stacked run a per-layer copy
        (:meth:`K3Model.layer_views`) — read it; parameters are written through the stored stacks."""
        if not 0 <= i < self.model.n_layers:
            raise IndexError(f"layer {i}: the model has {self.model.n_layers} layers")
        if self.model.layers[i] is not None:
            return self.model.layers[i]
        return unstack_run(self.model.run, self.model.scan_plan, only=i)[i]

    def router_biases(self) -> list[nnx.Variable | tuple[nnx.Variable, int]]:
        """Each MoE layer's router bias in layer order (the order of ``expert_counts`` and ``router_scores``): its
        variable ``[E]``, or ``(stacked variable [repeats, E], row)`` for a layer of the stacked run."""
        layout, out = RunLayout(self.model.scan_plan), []
        for i in self.config.moe_layers:
            at = layout.locate(i)
            if at is None:
                out.append(self.model.layers[i].block_sparse_moe.e_score_correction_bias)
            else:
                out.append((self.model.run[at[0]].block_sparse_moe.e_score_correction_bias, at[1]))
        return out

    def get_router_biases(self) -> list[jax.Array]:
        """Each MoE layer's router bias ``[E]``, in layer order."""
        return [v[...] if not isinstance(v, tuple) else v[0][...][v[1]] for v in self.router_biases()]

    def set_router_biases(self, values: list[jax.Array]) -> None:
        """Write each MoE layer's router bias (layer order); a stacked run's rows are written as one stack."""
        refs = self.router_biases()
        if len(values) != len(refs):
            raise ValueError(f"router biases: {len(values)} values for {len(refs)} MoE layers")
        stacks: dict[int, tuple[nnx.Variable, dict]] = {}
        for ref, v in zip(refs, values):
            if not isinstance(ref, tuple):
                ref[...] = v.astype(ref.dtype)
            else:
                stacks.setdefault(id(ref[0]), (ref[0], {}))[1][ref[1]] = v
        for var, rows in stacks.values():
            var[...] = jnp.stack([rows[j].astype(var.dtype) for j in range(len(rows))])
