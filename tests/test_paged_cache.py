"""The paged MLA latent cache: pages anywhere in a shared pool, a page table per slot, padding never written; the
model over a paged cache gives the contiguous cache's logits (itself checked against the expanded attention in
test_infer), and the slot pool's page allocator hands out and takes back every page."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import K3Config, K3ForCausalLM
from k3jax.infer.config import prefill_buckets
from k3jax.infer.slots import PageAllocator
from k3jax.nn.cache import Cache, MLACache, PagedMLACache, init_cache, init_paged_cache
from k3jax.ops.attention import mla_latent_attention, paged_block_pages


def random_table(rng, slots, max_pages, num_pages):
    """Each slot gets distinct pages drawn from the whole pool, in shuffled order (pages land anywhere)."""
    perm = rng.permutation(num_pages)[: slots * max_pages]
    return jnp.asarray(perm.reshape(slots, max_pages), jnp.int32)


def test_paged_append_and_attend_equal_the_contiguous_cache():
    rng = np.random.default_rng(0)
    B, L, R, Dr, page, P = 3, 64, 8, 4, 8, 40
    table = random_table(rng, B, L // page, P)
    paged = PagedMLACache(jnp.zeros((P, page, R)), jnp.zeros((P, page, Dr)), table)
    flat = MLACache(jnp.zeros((B, L, R)), jnp.zeros((B, L, Dr)))
    pos = jnp.asarray([0, 5, 17], jnp.int32)
    for n_new in ([20, 3, 9], [1, 0, 30]):                       # padding rows and an untouched slot
        c = jnp.asarray(rng.normal(size=(B, 30, R)), jnp.float32)
        kr = jnp.asarray(rng.normal(size=(B, 30, Dr)), jnp.float32)
        n = jnp.asarray(n_new, jnp.int32)
        paged, flat = paged.append(c, kr, pos, n), flat.append(c, kr, pos, n)
        pos = pos + n
    # every slot's tokens sit where its page table says; nothing else in the pool was written
    pool = np.asarray(paged.c_kv)
    written = np.zeros(P * page, bool)
    for b in range(B):
        for t in range(int(pos[b])):
            p = int(table[b, t // page])
            np.testing.assert_array_equal(pool[p, t % page], np.asarray(flat.c_kv)[b, t])
            written[p * page + t % page] = True
    assert not np.any(pool.reshape(P * page, R)[~written])
    q = jnp.asarray(rng.normal(size=(B, 2, 4, R)), jnp.float32)
    qr = jnp.asarray(rng.normal(size=(B, 2, 4, Dr)), jnp.float32)
    q_pos = pos[:, None] - jnp.asarray([1, 0])[None, :]
    want = mla_latent_attention(q, qr, flat.c_kv, flat.k_r, q_pos, pos, 0.3)
    got = paged.attend(q, qr, q_pos, pos, 0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert paged.capacity == L and paged.batch == B and paged_block_pages(8, 8) == 8 and paged_block_pages(6, 64) == 6


@pytest.fixture(scope="module")
def model():
    return K3ForCausalLM(K3Config.from_preset("test"), rngs=nnx.Rngs(3))


def test_model_over_a_paged_cache_equals_the_contiguous_cache(model):
    cfg = model.config
    rng = np.random.default_rng(1)
    B, L, page, P = 2, 64, 16, 11
    paged = init_paged_cache(cfg, B, P, page, L)
    paged = paged.with_page_table(random_table(rng, B, L // page, P))
    flat = init_cache(cfg, B, L)
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids, cache, n_new):
        out = nnx.merge(graphdef, state)(ids, cache=cache, n_new=n_new)
        return out.logits, out.cache

    # one chunk shape for every call (one compile per layout): a prefill of 12 and 7 tokens, then decode-like
    # chunks of one real token per slot, the second slot idle in the last
    T = 12
    for n_new in ([12, 7], [1, 1], [1, 1], [1, 0]):
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T)), jnp.int32)
        n = jnp.asarray(n_new, jnp.int32)
        lp, paged = fwd(state, ids, paged, n)
        lf, flat = fwd(state, ids, flat, n)
        for b in range(B):
            k = max(n_new[b], 1)
            np.testing.assert_allclose(np.asarray(lp[b, :k]), np.asarray(lf[b, :k]), rtol=1e-5, atol=1e-5)
    assert paged.lengths.tolist() == flat.lengths.tolist() == [15, 9]
    # slot operations: a one-slot view shares the pool, writing it back changes only that slot's table row
    row = paged.read_slots(1)
    assert isinstance(row, Cache) and row.batch == 1 and row.layers[-1].c_kv is paged.layers[-1].c_kv
    back = paged.write_slots(1, row)
    np.testing.assert_array_equal(np.asarray(back.layers[-1].page_table), np.asarray(paged.layers[-1].page_table))


def test_page_allocator_and_prefill_buckets():
    a = PageAllocator(5)
    got = a.alloc(3)
    assert got == [0, 1, 2] and a.free == 2 and a.alloc(3) is None and a.free == 2
    a.release(got)
    assert a.free == 5 and sorted(a.alloc(5)) == [0, 1, 2, 3, 4]
    assert prefill_buckets(256) == (16, 64, 256) and prefill_buckets(64) == (16, 64) and prefill_buckets(16) == (16,)
