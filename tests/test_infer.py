"""Inference engine: chunked prefill + cached decode against the full forward, batching, absorbed MLA, sampling,
tokenizers, errors, and no recompilation while decoding."""

import base64
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jit_forward
from k3jax import K3Config, K3ForCausalLM
from k3jax.infer import Engine, GenerationError, generate
from k3jax.nn.cache import cache_bytes, init_cache
from k3jax.infer.sampling import SamplingError, sample_next
from k3jax.ops.attention import mla_attention, mla_latent_attention


def config(kind: str) -> K3Config:
    """The ``test`` preset (KDA + gated MLA, AttnRes, LatentMoE with SiTU, q-LoRA: every K3 feature on), or the
    same with only KDA or only MLA layers: 3 of them, as in the preset (the dense-MLP layer and two MoE layers;
    AttnRes blocks of 2 cross a block boundary)."""
    cfg = K3Config.from_preset("test")
    lac = cfg.linear_attn_config
    if kind == "mixed":
        return cfg
    n = 3
    if kind == "kda":
        lac = dataclasses.replace(lac, kda_layers=list(range(1, n + 1)), full_attn_layers=[])
    elif kind == "mla":
        lac = dataclasses.replace(lac, kda_layers=[], full_attn_layers=list(range(1, n + 1)))
    return cfg.replace(num_hidden_layers=n, linear_attn_config=lac)


@pytest.fixture(scope="module")
def models():
    return {k: K3ForCausalLM(config(k), rngs=nnx.Rngs(1)) for k in ("mixed", "kda", "mla")}


@pytest.mark.parametrize("kind", ["mixed", "kda", "mla"])
def test_prefix_prefill_plus_decode_equals_full_forward(models, kind, rng):
    """The scoring prefill's logits at every position, and generation's (the serving scheduler and runner: chunked
    prefill of 20 tokens — one full chunk of 16, one padded — then 25 one-token decode steps over the paged cache,
    two prompts decoded together) at every generated position, against the full forward of the same sequence."""
    model = models[kind]
    ids = rng.integers(0, model.config.vocab_size, (2, 45)).astype(np.int32)
    full = np.asarray(jit_forward(model, jnp.asarray(ids)).logits)
    engine = Engine(model, chunk=16)                      # 3 prefill chunks, the last one padded
    _, all_logits, _ = engine.prefill(list(ids), all_logits=True)
    assert np.max(np.abs(np.asarray(all_logits) - full)) <= 1e-4
    res = engine.generate([row[:20] for row in ids], 25, record_logits=True)
    seqs = np.array([list(row[:20]) + t for row, t in zip(ids, res.tokens)], np.int32)      # 2 × 45, like ids
    full = np.asarray(jit_forward(model, jnp.asarray(seqs)).logits)
    assert np.max(np.abs(np.stack(res.logits) - full[:, 19:44])) <= 1e-4        # positions 19 … 43
    assert set(engine.traces) == {"score", "prefill", "decode", "decode+prefill"}


def test_batched_prompts_equal_one_by_one(models, rng):
    model = models["mixed"]
    lens = [1, 7, 64, 100]
    prompts = [list(rng.integers(0, model.config.vocab_size, n)) for n in lens]
    engine = Engine(model, chunk=32)
    batch = engine.generate(prompts, 6)
    _, last_b, _ = engine.prefill(prompts, 6)
    # the full forward of every prompt + its generation, right-padded into one batch (causal: padding after a
    # row's end cannot change its logits)
    seqs = [p + batch.tokens[i][:-1] for i, p in enumerate(prompts)]
    padded = np.zeros((len(seqs), max(map(len, seqs))), np.int32)
    for i, q in enumerate(seqs):
        padded[i, : len(q)] = q
    full_all = np.asarray(jit_forward(model, jnp.asarray(padded)).logits)
    for i, p in enumerate(prompts):
        alone = engine.generate([p], 6)
        assert alone.tokens[0] == batch.tokens[i]
        _, last_1, _ = engine.prefill([p], 6)
        assert np.max(np.abs(np.asarray(last_1[0]) - np.asarray(last_b[i]))) <= 1e-4
        full = full_all[i, len(p) - 1: len(seqs[i])]
        assert list(np.argmax(full, -1)) == batch.tokens[i]             # greedy = argmax of the full forward


def test_absorbed_latent_attention_equals_expanded(rng):
    B, T, N, R, Dn, Dr, Dv = 2, 37, 3, 16, 8, 4, 8
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    c_kv, k_r, q_n, q_r = f(B, T, R), f(B, T, Dr), f(B, T, N, Dn), f(B, T, N, Dr)
    w_k, w_v = f(R, N, Dn) / 4, f(R, N, Dv) / 4
    k_n = jnp.einsum("btr,rnd->btnd", c_kv, w_k)
    v = jnp.einsum("btr,rnd->btnd", c_kv, w_v)
    expanded = mla_attention(q_n, q_r, k_n, k_r, v, 0.2)
    L = 48                                                  # a bucket larger than T, in blocks of 8
    pad = lambda x: jnp.pad(x, ((0, 0), (0, L - T), (0, 0)))  # noqa: E731
    q_lat = jnp.einsum("btnd,rnd->btnr", q_n, w_k)
    o_lat = mla_latent_attention(q_lat, q_r, pad(c_kv), pad(k_r), jnp.tile(jnp.arange(T), (B, 1)),
                                 jnp.full((B,), T), 0.2, block=8)
    absorbed = jnp.einsum("btnr,rnd->btnd", o_lat, w_v)
    np.testing.assert_allclose(absorbed, expanded, atol=2e-5, rtol=1e-4)


def test_decode_never_recompiles_and_cache_is_constant_for_kda(models):
    model = models["mixed"]
    engine = Engine(model, chunk=32)       # chunk 32: the one-prompt steps test_batched_prompts compiled (cache hits)
    engine.generate([[1, 2, 3]], 40)
    first = dict(engine.traces)
    engine.generate([[4, 5, 6, 7, 8]], 40)                  # same batch and bucket: nothing new to compile
    assert engine.traces == first == {"prefill": 1, "decode": 1}
    cfg = model.config
    small, big = cache_bytes(init_cache(cfg, 1, 256)), cache_bytes(init_cache(cfg, 1, 4096))
    assert small["kda_recurrent_state"] == big["kda_recurrent_state"] > 0
    lac = cfg.linear_attn_config
    n_kda, n_mla = len(lac.kda_layers), len(lac.full_attn_layers)
    assert small["kda_recurrent_state"] == n_kda * lac.num_heads * lac.head_dim ** 2 * 4
    assert big["mla_latent_cache"] == n_mla * 4096 * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4


def test_sampling_settings(models):
    model = models["mixed"]
    p = [[5, 6, 7]]
    e = Engine(model, chunk=32)            # as in test_decode_never_recompiles: the same compiled steps
    greedy = e.generate(p, 8).tokens
    assert e.generate(p, 8, temperature=1.0, top_k=1).tokens == greedy
    assert e.generate(p, 8, temperature=1.0, top_p=1e-6).tokens == greedy
    a = e.generate(p, 8, temperature=1.5, seed=3).tokens
    assert a == e.generate(p, 8, temperature=1.5, seed=3).tokens                 # same seed → same output
    assert any(e.generate(p, 8, temperature=1.5, seed=s).tokens != a for s in range(4, 8))
    stop = greedy[0][2]
    out = e.generate(p, 8, stop_tokens=[stop]).tokens[0]
    assert out == greedy[0][: greedy[0].index(stop) + 1]
    assert generate(model, p[0], 8) == greedy[0]
    # no_repeat_ngram=n: no n-gram twice in prompt + output; until plain greedy first repeats one, the same tokens
    # (the random test model repeats single tokens within 40, not longer n-grams: n = 1 here, n > 1 in test_cli)
    plain = e.generate(p, 40).tokens[0]
    res = e.generate(p, 40, no_repeat_ngram=1)
    guarded = res.tokens[0]

    def first_repeat(seq, n=1):
        seen = set()
        for j in range(len(seq) - n + 1):
            if tuple(seq[j:j + n]) in seen:
                return j + n - 1                              # the token that completes the repeated n-gram
            seen.add(tuple(seq[j:j + n]))
        return None

    assert first_repeat(p[0] + guarded) is None
    rep = first_repeat(p[0] + plain)
    assert rep is not None, "the random test model's greedy output repeats a token within 40 tokens"
    cut = rep - len(p[0])
    assert guarded[:cut] == plain[:cut] and guarded[cut] != plain[cut]
    assert res.stats["no_repeat_ngram_changed"] >= 1
    with pytest.raises(GenerationError, match="no_repeat_ngram"):
        e.generate(p, 4, no_repeat_ngram=-1)
    # top-k / top-p restrict the support: 400 draws never leave it
    logits = jnp.asarray(np.linspace(0, 3, 50)[None].repeat(400, 0), jnp.float32)
    draws = np.asarray(sample_next(logits, jax.random.key(0), jnp.float32(1), jnp.int32(3), jnp.float32(1)))
    assert set(draws) <= {47, 48, 49} and len(set(draws)) == 3
    probs = np.asarray(jax.nn.softmax(logits[0]))[::-1]
    n_p = int(np.searchsorted(np.cumsum(probs), 0.5)) + 1          # smallest top set with mass ≥ 0.5
    draws = np.asarray(sample_next(logits, jax.random.key(1), jnp.float32(1), jnp.int32(0), jnp.float32(0.5)))
    assert set(draws) <= set(range(50 - n_p, 50)) and len(set(draws)) == n_p


def test_bad_requests_raise_named_errors(models):
    e = Engine(models["mixed"], chunk=16, max_len=64)
    with pytest.raises(GenerationError, match="prompt 0: empty"):
        e.generate([[]], 4)
    with pytest.raises(GenerationError, match="prompts: expected at least one"):
        e.generate([], 4)
    with pytest.raises(GenerationError, match=r"prompt 1: 60 tokens \+ max_new_tokens 10 = 70 exceeds .* 64"):
        e.generate([[1], [1] * 60], 10)
    with pytest.raises(GenerationError, match=r"max_position_embeddings=4096"):
        Engine(models["mixed"]).generate([[1] * 4000], 200)
    with pytest.raises(GenerationError, match=r"token ids must lie in \[0, 512\)"):
        e.generate([[1, 512]], 4)
    for kw, field in [({"temperature": -1.0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 1.5}, "top_p"),
                      ({"top_p": 0.0}, "top_p")]:
        with pytest.raises(SamplingError, match=field):
            e.generate([[1]], 4, **kw)
    with pytest.raises(SamplingError, match="max_new_tokens"):
        e.generate([[1]], -1)


def test_tiktoken_release_tokenizer_offline(tmp_path):
    """A release-style directory: tiktoken.model (256 byte tokens + merges) and tokenizer_config.json specials."""
    from k3jax.text.tokenizer import TiktokenTokenizer, load_tokenizer

    merges = [b"th", b"he", b"the", b" the", b"in", b"ing", "中文".encode()]
    ranks = [bytes([i]) for i in range(256)] + merges
    (tmp_path / "tiktoken.model").write_text(
        "\n".join(f"{base64.b64encode(t).decode()} {i}" for i, t in enumerate(ranks)) + "\n")
    base = len(ranks)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "added_tokens_decoder": {str(base): {"content": "[BOS]"}, str(base + 1): {"content": "[EOS]"},
                                 str(base + 2): {"content": "<|im_end|>"}},
        "bos_token": "[BOS]", "eos_token": "[EOS]"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, TiktokenTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.vocab_size) == (base, base + 1, base + 256)
    text = "the thing in the 中文 text<|im_end|>"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert ranks.index(b" the") in ids and base + 2 in ids and ranks.index("中文".encode()) in ids
    (tmp_path / "tiktoken.model").write_text("not-base64!! x\n")
    with pytest.raises(ValueError, match=r"tiktoken.model: line 1: expected '<base64 token> <rank>'"):
        load_tokenizer(tmp_path)


def test_generate_cli_on_a_preset(capsys):
    from k3jax.cli import main

    assert main(["generate", "--model", "test", "--prompt", "hi", "--max-new-tokens", "5", "--no-stream"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "cache per sequence" in out and "MLA latent" in out
