"""The grouped forward (``K3ForCausalLM.forward_groups``): several row groups of different shapes — decode rows, a
prefill chunk, speculative-verification rows — in one forward, each group getting what the ordinary forward gives
it alone: the logits of its real tokens, its KDA states and conv windows, and (over a paged slot pool) the page pool
after the groups' caches are written back in either order."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from k3jax import K3Config, K3ForCausalLM
from k3jax.nn.cache import Cache, KDACache, PagedMLACache, init_paged_cache
from k3jax.nn.layers import TokenGroups

SLOTS, PAGE, MAX_LEN, CHUNK = 6, 8, 64, 16


@pytest.fixture(scope="module")
def setup():
    """The test model, its jitted ordinary and grouped forwards, and a paged slot pool after a first prefill
    (distinct pages per slot, slots at different lengths)."""
    cfg = K3Config.from_preset("test")
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)

    @jax.jit
    def fwd(state, ids, cache, n_new, embeds=None):
        out = nnx.merge(graphdef, state)(ids, cache=cache, n_new=n_new, embeds=embeds)
        return out.logits, out.cache

    @jax.jit
    def fwd_record(state, ids, cache, n_new):
        out = nnx.merge(graphdef, state)(ids, cache=cache, n_new=n_new, kda_record=True)
        return out.logits, out.cache

    @functools.partial(jax.jit, static_argnames="record")
    def grouped(state, ids, caches, n_new, embeds=None, record=None):
        m = nnx.merge(graphdef, state)
        hidden, new = m.forward_groups(ids, caches, n_new, embeds=embeds, kda_record=record)
        return tuple(m.head(h) for h in hidden), new

    accept = jax.jit(lambda cache, n: cache.accept(n))

    rng = np.random.default_rng(0)
    max_pages = MAX_LEN // PAGE
    table = rng.permutation(SLOTS * max_pages + 3)[: SLOTS * max_pages].reshape(SLOTS, max_pages)
    pool = init_paged_cache(cfg, SLOTS, SLOTS * max_pages + 3, PAGE, MAX_LEN).with_page_table(table)
    for slot, n in enumerate([16, 5, 9, 12, 3, 7]):           # one prefill chunk per slot (the tests' chunk shape)
        ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (1, CHUNK)), jnp.int32)
        _, c = fwd(state, ids, pool.read_slots(slot), jnp.asarray([n], jnp.int32))
        pool = pool.write_slots(slot, c)
    return dict(model=model, cfg=cfg, state=state, fwd=fwd, fwd_record=fwd_record, grouped=grouped, accept=accept,
                pool=pool,
                rng=rng)


def ids_of(s, shape):
    return jnp.asarray(s["rng"].integers(0, s["cfg"].vocab_size, shape), jnp.int32)


def i32(x):
    return jnp.asarray(x, jnp.int32)


def assert_logits_close(got, want, n_new, atol):
    """The logits of each row's first ``n_new[b]`` tokens (the padding's are not compared)."""
    for b, n in enumerate(np.asarray(n_new)):
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=atol, rtol=0, err_msg=f"row {b}")


def assert_kda_close(got: Cache, want: Cache):
    """Every KDA layer's state and conv windows ≤ 1e-6, the lengths equal."""
    np.testing.assert_array_equal(got.lengths, want.lengths)
    for i, (g, w) in enumerate(zip(got.layers, want.layers)):
        assert type(g) is type(w), i
        if isinstance(w, KDACache):
            for f in ("state", "conv_q", "conv_k", "conv_v"):
                np.testing.assert_allclose(getattr(g, f), getattr(w, f), atol=1e-6, rtol=0, err_msg=f"{i} {f}")


def assert_pool_close(got: Cache, want: Cache):
    """The whole slot pool: KDA rows and lengths (see above), page tables equal, every page ≤ 1e-5 (the latents
    of one token come from GEMMs of different shapes: rounding apart; a token missing would differ by O(1))."""
    assert_kda_close(got, want)
    for g, w in zip(got.layers, want.layers):
        if isinstance(w, PagedMLACache):
            np.testing.assert_array_equal(g.page_table, w.page_table)
            np.testing.assert_allclose(g.c_kv, w.c_kv, atol=1e-5, rtol=0)
            np.testing.assert_allclose(g.k_r, w.k_r, atol=1e-5, rtol=0)


def test_decode_rows_and_a_prefill_chunk_over_a_paged_pool(setup):
    """Decode rows [4, 1] (one idle) + a prefill chunk [1, 16] (11 real tokens) in one forward against the two
    groups run one after the other through the ordinary forward; the pool written back in both orders."""
    s = setup
    pool, state = s["pool"], s["state"]
    slots = (i32([0, 2, 3, 5]), i32([4]))
    ids = (ids_of(s, (4, 1)), ids_of(s, (1, CHUNK)))
    n_new = (i32([1, 1, 0, 1]), i32([11]))
    logits, new = s["grouped"](state, ids, tuple(pool.read_slots(x) for x in slots), n_new)

    seq, want = pool, []
    for x, i, n in zip(slots, ids, n_new):
        lg, c = s["fwd"](state, i, seq.read_slots(x), n)
        seq = seq.write_slots(x, c)
        want.append((lg, c))
    for g in range(2):
        assert_logits_close(logits[g], want[g][0], n_new[g], atol=1e-5)
        assert_kda_close(new[g], want[g][1])
    np.testing.assert_array_equal(new[0].lengths, pool.lengths[slots[0]] + n_new[0])
    for order in ((0, 1), (1, 0)):
        back = pool
        for g in order:
            back = back.write_slots(slots[g], new[g])
        assert_pool_close(back, seq)
    # both groups' caches carry the one final pool
    for a, b in zip(new[0].layers, new[1].layers):
        if isinstance(a, PagedMLACache):
            assert a.c_kv is b.c_kv or np.array_equal(a.c_kv, b.c_kv)


def test_verify_rows_and_a_chunk_with_image_rows(setup):
    """Verification rows [2, 3] recording (``kda_record``) + a prefill chunk whose rows 2…8 are image rows
    (``embeds``): the verify logits, ``accept(n)`` of the pending caches, and the chunk's logits and cache equal
    the separate runs'."""
    s = setup
    pool, state, cfg = s["pool"], s["state"], s["cfg"]
    slots = (i32([1, 3]), i32([0]))
    ids = (ids_of(s, (2, 3)), ids_of(s, (1, CHUNK)))
    n_new = (i32([3, 3]), i32([14]))
    rows = jnp.asarray(s["rng"].normal(size=(1, CHUNK, cfg.hidden_size)) * 0.02, jnp.float32)
    mask = (jnp.arange(CHUNK) >= 2) & (jnp.arange(CHUNK) < 9)
    embeds = (None, (rows, mask[None]))
    caches = tuple(pool.read_slots(x) for x in slots)
    logits, new = s["grouped"](state, ids, caches, n_new, embeds, record=(True, False))
    assert new[0].pending and not new[1].pending

    lv, cv = s["fwd_record"](state, ids[0], caches[0], n_new[0])
    lc, cc = s["fwd"](state, ids[1], caches[1], n_new[1], embeds[1])
    assert_logits_close(logits[0], lv, n_new[0], atol=1e-5)
    assert_logits_close(logits[1], lc, n_new[1], atol=1e-5)
    assert_kda_close(new[1], cc)
    n = i32([2, 0])
    assert_kda_close(s["accept"](new[0], n), s["accept"](cv, n))
    # the image rows matter: the chunk without them gives other logits
    plain, _ = s["fwd"](state, ids[1], caches[1], n_new[1])
    assert np.abs(np.asarray(plain[0, 2:14]) - np.asarray(lc[0, 2:14])).max() > 1e-3


def test_one_group_equals_the_ordinary_forward(setup):
    """With a single group the grouped forward is the ordinary forward on a flattened batch: logits and every
    cache leaf ≤ 1e-6."""
    s = setup
    pool, state = s["pool"], s["state"]
    slot = i32([0, 2, 3, 5])
    ids, n_new = ids_of(s, (4, 1)), i32([1, 0, 1, 1])
    logits, new = s["grouped"](state, (ids,), (pool.read_slots(slot),), (n_new,))
    want_logits, want = s["fwd"](state, ids, pool.read_slots(slot), n_new)
    assert_logits_close(logits[0], want_logits, n_new, atol=1e-6)
    for g, w in zip(jax.tree.leaves(new[0]), jax.tree.leaves(want)):
        np.testing.assert_allclose(g, w, atol=1e-6, rtol=0)


def test_token_groups_split_and_join():
    groups = TokenGroups([(2, 3), (1, 4)])
    x = jnp.arange(10 * 2).reshape(1, 10, 2)
    parts = groups.split(x)
    assert [p.shape for p in parts] == [(2, 3, 2), (1, 4, 2)] and groups.n_tokens == 10
    np.testing.assert_array_equal(parts[1][0, :, 0], [12, 14, 16, 18])
    np.testing.assert_array_equal(groups.join(parts), x)


def test_inputs_are_checked(setup):
    s = setup
    model, pool = s["model"], s["pool"]
    ids = (i32(np.zeros((2, 1))), i32(np.zeros((1, 4))))
    caches = (pool.read_slots(i32([0, 1])), pool.read_slots(i32([2])))
    n_new = (i32([1, 1]), i32([4]))
    with pytest.raises(ValueError, match=r"caches\[1\]: batch 2 != input_ids\[1\] batch 1"):
        model.forward_groups(ids, (caches[0], caches[0]), n_new)
    with pytest.raises(ValueError, match=r"n_new\[0\]"):
        model.forward_groups(ids, caches, (i32([1]), n_new[1]))
    with pytest.raises(ValueError, match=r"n_new: 1 groups"):
        model.forward_groups(ids, caches, n_new[:1])
    with pytest.raises(ValueError, match=r"embeds\[1\]"):
        model.forward_groups(ids, caches, n_new, embeds=(None, (jnp.zeros((1, 3, 64)), jnp.zeros((1, 3), bool))))
    with pytest.raises(ValueError, match=r"kda_record: 3 groups"):
        model.forward_groups(ids, caches, n_new, kda_record=(True, False, False))
    with pytest.raises(ValueError, match=r"input_ids\[0\]: expected integer"):
        model.forward_groups((jnp.zeros((2, 1)), ids[1]), caches, n_new)
    with pytest.raises(ValueError, match=r"input_ids\[1\]: an empty group"):
        model.forward_groups((ids[0], i32(np.zeros((1, 0)))), caches, n_new)
