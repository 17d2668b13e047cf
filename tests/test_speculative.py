"""Speculative decoding with KDA state replay, on the ``test`` preset (3 KDA + 2 MLA layers, AttnRes, MoE).

* the recording forward + :meth:`Cache.accept` = plain decoding of the accepted tokens (KDA state and conv windows
  ≤ 1e-6, logits ≤ 1e-5), and what a slot holds during a round is one state + the recorded inputs (measured);
* the acceptance rule leaves the target's distribution unchanged (χ² on 200k rounds, fixed seed), and the test
  would see an off-by-one in the residual;
* in the scheduler, greedy output with speculation = without, token for token (logits ≤ 1e-5), for drafts that are
  all accepted, none, up to each position and random, in batches where every slot accepts a different length, with
  prefix-cache hits (every hit recomputed from scratch: ``prefix_verify``), with a draft model; the fallback;
* the server: ``--speculative`` through the ``openai`` client, a per-request opt-out, the metrics.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import jit_forward
from k3jax import K3Config, K3ForCausalLM
from k3jax.infer import EngineConfig
from k3jax.infer.proposers import FunctionProposer, PromptLookup
from k3jax.infer.sampling import sampling_probs
from k3jax.infer.scheduler import SamplingParams, Scheduler
from k3jax.infer.speculative import (AcceptanceTracker, NgramIndex, SpecConfig, emitted_tokens, ngram_propose,
                                     speculative_accept)
from k3jax.nn.cache import KDACache, KDAPending, init_cache, kda_record_bytes, slot_state_bytes

K = 3                       # drafts per round in the schedulers below
MAX_LEN, PAGE, BLOCK, CHUNK = 512, 32, 64, 32


@pytest.fixture(scope="module")
def model():
    """The ``test`` preset with the weights ``k3jax generate --model test`` loads (``nnx.Rngs(0)``)."""
    return K3ForCausalLM(K3Config.from_preset("test"), rngs=nnx.Rngs(0))


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


# ------------------------------------------------------------------------------------------------- the model
def test_recorded_round_accepts_each_length_like_plain_decode(model):
    """A recording forward of T = 4 tokens, then ``accept(n)`` with n = 0…4 in one batch, against decoding the
    same tokens one by one: every KDA layer's state and conv windows ≤ 1e-6, the logits ≤ 1e-5."""
    cfg, T, B = model.config, 4, 5
    prompt = np.stack([tokens(b, 12) for b in range(B)])
    c0 = init_cache(cfg, B, 64)
    for t in range(prompt.shape[1]):                       # the prompt through the decode step: one compile less
        c0 = jit_forward(model, jnp.asarray(prompt[:, t:t + 1], jnp.int32), cache=c0).cache
    steps = jnp.asarray(np.stack([tokens(100 + b, T) for b in range(B)]), jnp.int32)
    plain, c = [c0], c0
    logits = []
    for t in range(T):
        out = jit_forward(model, steps[:, t:t + 1], cache=c)
        c = out.cache
        plain.append(c)
        logits.append(out.logits[:, 0])
    rec = jit_forward(model, steps, cache=c0, kda_record=True)
    assert rec.cache.pending and int(rec.cache.lengths[0]) == 12
    np.testing.assert_allclose(rec.logits, jnp.stack(logits, 1), atol=1e-5)
    n = jnp.arange(B, dtype=jnp.int32)                     # row b keeps b tokens
    kept = rec.cache.accept(n)
    np.testing.assert_array_equal(kept.lengths, 12 + n)
    for b in range(B):
        for got, want in zip(kept.layers, plain[b].layers):
            if isinstance(want, KDACache):
                for f in ("state", "conv_q", "conv_k", "conv_v"):
                    np.testing.assert_allclose(getattr(got, f)[b], getattr(want, f)[b], atol=1e-6, err_msg=f)

    # what a slot holds during the round: one KDA state (+ windows) and T recorded tokens, not T states
    pend = [c for c in rec.cache.layers if isinstance(c, KDAPending)]
    held = sum(x.nbytes for c in pend for x in jax.tree.leaves(c)) // B
    assert held == slot_state_bytes(cfg) + kda_record_bytes(cfg, T)
    assert held < T * slot_state_bytes(cfg)
    with pytest.raises(ValueError, match="kda_record"):
        model(steps, kda_record=True)


# ------------------------------------------------------------------------------------------- the acceptance rule
def _rounds(p, q, drafts, n_draft, N, seed=0, temperature=1.0):
    """N independent rounds of :func:`speculative_accept` on fixed target distributions ``p [k+1, V]`` (as logits)
    and drafts: ``drafts`` [N, k] (drawn from ``q``) or None; returns the emitted tokens [N, k+1] and counts."""
    k = p.shape[0] - 1
    logits = jnp.broadcast_to(jnp.log(p), (N, k + 1, p.shape[1]))
    seeds = jnp.arange(seed, seed + N, dtype=jnp.uint32)
    qb = None if q is None else jnp.broadcast_to(q, (N, k, p.shape[1]))
    settings = (jnp.full((N,), temperature), jnp.zeros((N,), jnp.int32), jnp.ones((N,)))
    n_acc, tok = jax.jit(speculative_accept)(logits, drafts, jnp.full((N,), n_draft, jnp.int32), qb, seeds,
                                             jnp.zeros((N,), jnp.int32), *settings)
    return np.asarray(emitted_tokens(drafts, n_acc, tok)), np.asarray(n_acc)


def _tv(counts: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(counts / counts.sum() - p).sum())


def _chi2_sf(x: float, df: int) -> float:
    """P(χ²_df > x), the closed form for integer degrees of freedom."""
    import math

    if df % 2 == 0:
        return math.exp(-x / 2) * sum((x / 2) ** i / math.factorial(i) for i in range(df // 2))
    term, tail = 1.0, 0.0
    for i in range(1, (df - 1) // 2 + 1):
        term = (1.0 if i == 1 else term * x / (2 * i - 1))
        tail += term
    return math.erfc(math.sqrt(x / 2)) + math.sqrt(2 * x / math.pi) * math.exp(-x / 2) * tail


def _chi2_ok(counts: np.ndarray, p: np.ndarray) -> bool:
    """χ² goodness of fit at the 1e-4 level (fixed seed: deterministic)."""
    expected = counts.sum() * p
    stat = float(((counts - expected) ** 2 / expected).sum())
    return _chi2_sf(stat, len(p) - 1) > 1e-4


@pytest.mark.parametrize("drafter", ["point", "sampled"])
def test_rejection_sampling_keeps_the_target_distribution(drafter):
    """200k rounds with V = 6, k = 3 and fixed per-position target distributions p_t: the first emitted token is
    distributed as p_0, the token after an accepted first draft as p_1 (χ²). An off-by-one in the residual (drawing
    from p_{t+1} instead of p_t) would move the first token's distribution by a total variation of ≥ 0.1; the
    observed one is within 0.005."""
    rng = np.random.default_rng(0)
    V, k, N = 6, 3, 200_000
    p = rng.dirichlet(np.ones(V), size=k + 1).astype(np.float32)
    q = (0.5 * p[:k] + 0.5 * rng.dirichlet(np.ones(V), size=k)).astype(np.float32)   # a drafter near the target
    if drafter == "point":
        d = np.array([int(np.argmax(p[t])) for t in range(k)], np.int32)
        drafts, qq = jnp.broadcast_to(jnp.asarray(d), (N, k)), None
    else:
        drafts = jnp.stack([jax.random.categorical(jax.random.key(10 + t), jnp.log(q[t]), shape=(N,))
                            for t in range(k)], 1).astype(jnp.int32)
        qq = jnp.asarray(q)
    em, n_acc = _rounds(jnp.asarray(p), qq, drafts, k, N)
    first = np.bincount(em[:, 0], minlength=V)
    assert _chi2_ok(first, p[0]) and _tv(first, p[0]) < 0.005
    d0 = np.asarray(drafts[:, 0])
    after = em[(n_acc >= 1)][:, 1]                     # the first draft accepted: the next token ~ p_1
    cnt = np.bincount(after, minlength=V)
    assert cnt.sum() > 40_000 and _chi2_ok(cnt, p[1]) and _tv(cnt, p[1]) < 0.01
    # the off-by-one residual's first-token distribution (analytically) is far from p_0: the test would see it
    qd = np.zeros((N, V)) if qq is None else np.asarray(q)[0][None].repeat(N, 0)
    if qq is None:
        qd[np.arange(N), d0] = 1.0
    acc = np.minimum(1.0, p[0][d0] / qd[np.arange(N), d0])
    wrong = np.maximum(p[1][None] - qd, 0)
    wrong /= wrong.sum(1, keepdims=True)
    off = np.zeros(V)
    np.add.at(off, d0, acc)
    off += ((1 - acc)[:, None] * wrong).sum(0)
    assert _tv(off * N, p[0]) > 0.1


def test_greedy_rows_accept_while_the_draft_is_the_argmax():
    V, k = 7, 3
    logits = jnp.asarray(np.random.default_rng(1).normal(size=(4, k + 1, V)), jnp.float32)
    best = np.asarray(jnp.argmax(logits, -1))
    drafts = best[:, :k].copy()
    drafts[1, 0] = (drafts[1, 0] + 1) % V               # row 1: none accepted; row 2: one; row 3: n_draft = 1
    drafts[2, 1] = (drafts[2, 1] + 1) % V
    n_draft = jnp.asarray([3, 3, 3, 1])
    z = jnp.zeros((4,))
    n_acc, tok = jax.jit(speculative_accept, static_argnums=3)(
        logits, jnp.asarray(drafts), n_draft, None, jnp.arange(4, dtype=jnp.uint32), z.astype(jnp.int32), z,
        z.astype(jnp.int32), z + 1)
    np.testing.assert_array_equal(n_acc, [3, 0, 1, 1])
    np.testing.assert_array_equal(tok, [best[0, 3], best[1, 0], best[2, 1], best[3, 1]])


def test_sampling_probs_is_the_filtered_softmax():
    """temperature, top-k and top-p as plain sampling applies them, against a NumPy closed form."""
    x = np.random.default_rng(2).normal(size=(1, 9)).astype(np.float32) * 3
    for t, tk, tp in [(0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.6), (0.5, 3, 0.9)]:
        z = x[0] / t
        order = np.argsort(-z)
        keep = np.zeros(9, bool)
        keep[order[:tk or 9]] = True
        pz = np.exp(z - z.max()) / np.exp(z - z.max()).sum()
        mass_before = np.cumsum(pz[order]) - pz[order]
        keep[order[mass_before >= tp]] = False
        want = np.where(keep, np.exp(z - z.max()), 0)
        got = sampling_probs(jnp.asarray(x), jnp.float32(t), jnp.int32(tk), jnp.float32(tp))[0]
        np.testing.assert_allclose(got, want / want.sum(), atol=1e-6)
    np.testing.assert_array_equal(sampling_probs(jnp.asarray(x), 0.0, 0, 1.0)[0], np.eye(9)[np.argmax(x)])


# ----------------------------------------------------------------------------------------------- prompt lookup
def test_ngram_index_finds_the_latest_longest_match():
    rng = np.random.default_rng(3)
    for _ in range(200):
        seq = [int(t) for t in rng.integers(0, 4, rng.integers(1, 40))]
        want = []
        for n in range(min(4, len(seq)), 1, -1):                  # brute force: longest n, latest earlier start
            suf = seq[-n:]
            starts = [i for i in range(len(seq) - n) if seq[i:i + n] == suf]
            if starts:
                e = starts[-1] + n
                want = seq[e:e + 3]
                break
        idx = NgramIndex(2, 4)
        for t in seq:                                             # grown one token at a time
            idx.extend([t])
        assert idx.propose(3) == want == ngram_propose(seq, 3), seq


def test_ngram_index_follows_a_predicted_output():
    """A reference (predicted output): proposed from its start while the answer follows it, re-found two tokens after
    an edit, followed in order (the cursor) though an n-gram repeats in it."""
    ref = [10, 11, 12, 13, 14, 10, 11, 15, 16, 17]
    idx = NgramIndex(2, 4, reference=ref, prompt_len=2)
    idx.extend([1, 2])
    assert idx.propose(3) == [10, 11, 12]                      # nothing generated yet: the reference's start
    idx.extend([10, 11, 12, 99])                               # an edit: 99 for 13
    assert idx.propose(3) == []
    idx.extend([14, 10])                                       # (14, 10) found again after the edit
    assert idx.propose(3) == [11, 15, 16]
    idx.extend([11])                                           # (10, 11) occurs twice: the one after the cursor
    assert idx.propose(2) == [15, 16]
    both = NgramIndex(2, 4, reference=[5, 6, 9], prompt_len=6)
    both.extend([1, 5, 6, 7, 1, 5, 6])
    assert both.propose(2) == [7, 1]                           # the context's 3-gram match beats the reference's 2
    tie = NgramIndex(2, 4, reference=[5, 6, 9], prompt_len=5)
    tie.extend([5, 6, 7, 8, 5, 6])
    assert tie.propose(2) == [9]                               # equal lengths: the reference


def test_spec_config_parsing_names_the_problem():
    assert SpecConfig.parse("ngram:4") == SpecConfig("ngram", 4)
    assert SpecConfig.parse("ngram:2:1:3") == SpecConfig("ngram", 2, prompt_lookup_min=1, prompt_lookup_max=3)
    assert SpecConfig.parse("draft:runs/a:b:5") == SpecConfig("draft", 5, draft="runs/a:b")
    for bad, msg in [("ngram", "expected ngram"), ("ngram:x", "expected ngram"), ("ngram:0", "k \\(drafted"),
                     ("ngram:17", "k \\(drafted"), ("draft:4", "expected"), ("medusa:4", "expected"),
                     ("ngram:3:4:2", "prompt_lookup_min")]:
        with pytest.raises(ValueError, match=msg):
            SpecConfig.parse(bad)


def test_acceptance_tracker_backs_off_and_probes():
    t = AcceptanceTracker()
    t.update(4, 0, generated=10)
    assert t.active(11)                      # one failed round: still drafting (0.35)
    t.update(4, 0, generated=15)             # rate 0.245 < 0.25: off for 16 tokens
    assert not t.active(30) and t.active(31)
    t.update(4, 0, generated=31)             # the probe fails: off for 32 at once
    assert not t.active(62) and t.active(63)
    t.update(4, 4, generated=63)             # a probe that holds: drafting again, backoff back to 16
    assert t.active(64) and t.backoff == t.min_backoff and t.rate == pytest.approx(0.65)
    assert t.expected_tokens(2) == pytest.approx(1 + 2 * 0.65)


def test_acceptance_tracker_is_optimistic_until_it_has_seen_a_round():
    """Before a request's first round and for each probe the rate is unknown, so a round is expected to land every
    draft (n + 1 tokens): a round that costs more than 1 + prior + prior² + … plain steps is still tried once."""
    t = AcceptanceTracker()
    assert t.exploring and t.expected_tokens(8) == 9.0
    t.update(8, 2, generated=5)              # rate 0.65 * 0.5 + 0.35 * 0.25
    assert not t.exploring and t.expected_tokens(2) == pytest.approx(1 + 2 * t.rate)
    t.update(8, 0, generated=9)
    t.update(8, 0, generated=10)             # under the floor: backs off, then probes
    assert t.rate == t.prior and not t.active(11)   # reset to the prior for the probe
    assert t.probing and t.exploring and t.expected_tokens(3) == 4.0


# ------------------------------------------------------------------------------------------------ the scheduler
class Oracle:
    """Host drafts from the plain greedy answer of the same prompt: the request id says which drafts of a round are
    right (``all``, ``none``, ``upI`` — the first I right, then wrong — or ``rnd``, each right with p = 0.6)."""

    def __init__(self):
        self.answers: dict[tuple, list[int]] = {}
        self.rng = np.random.default_rng(0)

    def __call__(self, req, n):
        want = self.answers.get(tuple(req.prompt))
        mode = req.id.split("-")[0]
        if want is None or mode == "plain":
            return []
        d = want[len(req.tokens):len(req.tokens) + n]
        wrong = lambda t: (t + 1) % 512  # noqa: E731
        if mode == "none":
            return [wrong(t) for t in d]
        if mode.startswith("up"):
            i = int(mode[2:])
            return d[:i] + [wrong(t) for t in d[i:]]
        if mode == "rnd":
            return [t if self.rng.random() < 0.6 else wrong(t) for t in d]
        return d


@pytest.fixture(scope="module")
def sched(model):
    s = Scheduler(model, EngineConfig(max_slots=4, max_model_len=MAX_LEN, page_size=PAGE, chunk=CHUNK,
                                      prefix_cache_block=BLOCK, prefix_cache_verify=True, record_logits=True,
                                      speculative=SpecConfig("ngram", K, adaptive=False)))
    s.warmup()
    s.warm_compiles = dict(s.runner.traces)
    s.start()
    yield s
    s.close()


class proposer:
    """``with proposer(sched, p): …`` — the scheduler drafts with ``p`` inside (set on its thread)."""

    def __init__(self, sched, p):
        self.sched, self.p = sched, p

    def __enter__(self):
        self.old = self.sched.call(lambda: self.sched.spec.proposer)
        self.sched.call(lambda: setattr(self.sched.spec, "proposer", self.p))

    def __exit__(self, *exc):
        self.sched.call(lambda: setattr(self.sched.spec, "proposer", self.old))


_ids = iter(range(10 ** 6))


def submit(sched, prompt, mode, n=24, **kw):
    return sched.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw),
                        request_id=f"{mode}-{next(_ids)}", use_speculative=mode != "plain")


_refs: dict = {}


def reference(sched, prompt, n=24):
    """The request without speculation (and without the prefix cache): tokens and logits, memoised."""
    key = (tuple(prompt), n)
    if key not in _refs:
        r = sched.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True), use_speculative=False,
                         use_prefix_cache=False)
        r.result(timeout=300)
        _refs[key] = r
    return _refs[key]


def assert_same(sched, r, n=24):
    r.result(timeout=300)
    ref = reference(sched, r.prompt, n)
    assert r.finish_reason == "length", (r.finish_reason, r.error)
    assert r.tokens == ref.tokens, r.id
    assert len(r.logits) == len(ref.logits) == n
    err = max(float(np.abs(a - b).max()) for a, b in zip(r.logits, ref.logits))
    assert err <= 1e-5, (r.id, err)


def test_greedy_output_is_plain_greedy_for_every_acceptance_pattern(sched):
    """Four requests at a time, each with a different acceptance pattern (so every round's slots keep different
    lengths): tokens equal the plain answer, logits within 1e-5."""
    oracle = Oracle()
    with proposer(sched, FunctionProposer(oracle)):
        prompts = [tokens(s, n) for s, n in [(1, 30), (2, 70), (3, 5), (4, 100)]]
        for p in prompts:
            oracle.answers[tuple(p)] = reference(sched, p).tokens
        before = sched.call(lambda: dict(sched.spec.counters))
        for modes in (["all", "none", "up1", "up2"], ["rnd", "up2", "all", "none"]):
            reqs = [submit(sched, p, m) for p, m in zip(prompts, modes)]
            for r in reqs:
                assert_same(sched, r)
            got = {r.id.split("-")[0]: (r.spec.drafted, r.spec.accepted) for r in reqs}
            assert got["all"] == (17, 17)            # 23 tokens after the prefill's: 6 rounds (5 × 4, then 2 + 1)
            assert got["none"][0] > 0 and got["none"][1] == 0
            assert 0 < got["up2"][1] < got["up2"][0]
        c = sched.call(lambda: dict(sched.spec.counters))
        assert c["spec_accepted_tokens"] > before["spec_accepted_tokens"] and c["spec_steps"] > before["spec_steps"]


def test_prompt_lookup_speculates_and_stays_exact(sched):
    """Real prompt lookup over a prompt holding most token ids (1-grams: nearly every step finds a match; the random
    model rarely continues the way the prompt did, so most drafts fail): the output is still the plain answer."""
    p = [int(t) for t in np.random.default_rng(5).permutation(480)]
    with proposer(sched, PromptLookup(1, 4)):
        r = submit(sched, p, "lookup")
        assert_same(sched, r)
    assert r.spec.drafted >= 5 * K, r.spec.drafted


def test_a_predicted_output_is_drafted_from(sched):
    """OpenAI's predicted output: the plain answer with one token changed — the answer follows it, and after the
    edit prompt lookup finds its place in it again: most drafts are accepted, the output is the plain answer."""
    p = tokens(60, 50)
    pred = list(reference(sched, p).tokens)
    pred[10] = (pred[10] + 1) % 512
    r = sched.submit(p, SamplingParams(max_tokens=24, ignore_eos=True), prediction=pred)
    assert_same(sched, r)
    assert r.spec.accepted >= 12 and r.spec.accepted > r.spec.drafted // 2, (r.spec.drafted, r.spec.accepted)
    with pytest.raises(Exception, match="prediction: token ids"):
        sched.submit(p, SamplingParams(max_tokens=4), prediction=[600])


def test_prefix_cache_hits_with_speculation(sched):
    """A shared 150-token prefix (hits at 128, the 64-token block boundary) and a second turn that extends the
    first answer past a boundary crossed while decoding speculatively: the checkpoint saved there — at exactly the
    boundary, the round capped to land on it — is what the hit starts from; every hit is recomputed from scratch
    and compared (``prefix_verify``), every answer equals the plain one."""
    oracle = Oracle()
    with proposer(sched, FunctionProposer(oracle)):
        shared = tokens(20, 150)
        a, b = shared + tokens(21, 20), shared + tokens(22, 20)
        for p in (a, b):
            oracle.answers[tuple(p)] = reference(sched, p, 40).tokens
        ra = submit(sched, a, "all", 40)
        assert_same(sched, ra, 40)
        rb = submit(sched, b, "rnd", 40)
        assert_same(sched, rb, 40)
        assert rb.cached_tokens == 128 and rb.spec.accepted > 0
        turn2 = a + ra.tokens + tokens(23, 10)      # 170 + 40 = 210 crossed 192 in decode
        oracle.answers[tuple(turn2)] = reference(sched, turn2, 24).tokens
        r2 = submit(sched, turn2, "up2")
        assert_same(sched, r2)
        assert r2.cached_tokens == 192
    s = sched.call(lambda: dict(sched.prefix.index.stats))
    assert s["verify_failures"] == 0 and s["verified"] >= 2


def test_sampled_requests_are_reproducible(sched):
    """Randomness is per token (the seed and the token's number), so two requests with one seed give the same
    tokens though their rounds fall in different steps (the second prefills while the first decodes)."""
    oracle = Oracle()
    with proposer(sched, FunctionProposer(oracle)):
        p = tokens(30, 40)
        oracle.answers[tuple(p)] = reference(sched, p).tokens
        runs = [submit(sched, p, "all", temperature=0.8, top_k=50, seed=11) for _ in range(2)]
        outs = [r.result(timeout=300) for r in runs]
        assert outs[0] == outs[1] and len(outs[0]) == 24 and all(r.spec.drafted > 0 for r in runs)


def test_adaptive_fallback_stops_drafting_when_drafts_fail(sched):
    """With always-wrong drafts a request stops drafting after two rounds, probes once after 16 tokens and, the
    probe failing, stops for 32 (equal measured step costs, so only the acceptance rate decides)."""
    oracle = Oracle()
    p = tokens(40, 30)
    oracle.answers[tuple(p)] = reference(sched, p, 48).tokens
    sp = sched.spec
    saved = sched.call(lambda: (sp.config, sp.observe, sp.step_seconds))

    def equal_costs():
        sp.config = dataclasses.replace(sp.config, adaptive=True)
        sp.observe = lambda key, seconds: None
        sp.step_seconds = {(kind, b, 0): 1.0 for kind in ("verify", "decode") for b in sched.sizes.decode}

    sched.call(equal_costs)
    try:
        with proposer(sched, FunctionProposer(oracle)):
            r = submit(sched, p, "none", 48)
            assert_same(sched, r, 48)
        # two failed rounds (at tokens 1, 2), off until 18; the probe there fails, off for 32: none in 48 tokens
        assert r.spec.drafted == 3 * K and r.spec.accepted == 0
    finally:
        def restore():
            sp.config, sp.step_seconds = saved[0], saved[2]
            del sp.observe                                # the method again
        sched.call(restore)


def test_metrics_and_memory(sched):
    snap = sched.snapshot()["spec"]
    assert snap["method"] == "ngram" and snap["k"] == K and snap["draft_tokens"] > 0
    assert snap["acceptance_rate"] == pytest.approx(snap["accepted_tokens"] / snap["draft_tokens"])
    assert snap["mean_accepted_length"] == pytest.approx(snap["accepted_tokens"] / snap["rounds"])
    assert sched.snapshot()["compiles"] == sched.warm_compiles          # nothing compiled while serving
    assert sched.warm_compiles["spec"] == 1 and "spec+prefill" not in sched.warm_compiles   # a round + chunk: 2 forwards
    mem = sched.memory()
    assert mem["spec_record_bytes_per_slot"] == kda_record_bytes(sched.cfg, K + 1)
    assert mem["spec_record_bytes_per_slot"] < mem["spec_state_snapshots_bytes_per_slot"]
    # idle: every slot free, every page either free or held by the prefix cache (drafts' extra pages returned)
    snap = sched.call(sched.snapshot)
    assert not sched.busy() and snap["free_pages"] + snap["prefix"]["cached_pages"] == snap["num_pages"]


# ------------------------------------------------------------------------------------------------- the server
def test_server_speculates_through_the_openai_client(sched, tmp_path):
    """The module scheduler behind the OpenAI API: prompt lookup drafts, the answer's ids equal the plain answer's;
    ``"speculative": false`` (a request field) decodes plainly; ``/metrics`` has the ``k3jax_spec_*`` series."""
    import httpx
    import openai

    from k3jax.serve.app import ServeConfig, create_app
    from k3jax.serve.server import Server, free_port
    from k3jax.text.tokenizer import TiktokenTokenizer
    from tokenizer_fixture import write_release_tokenizer

    write_release_tokenizer(tmp_path)
    tok = TiktokenTokenizer(tmp_path)
    app = create_app(sched, tok, ServeConfig("k3-spec", MAX_LEN, own_scheduler=False))
    srv = Server(sched, tok, app, "127.0.0.1", free_port(), "k3-spec").start_background()
    done = []
    sched.finish_hooks.append(done.append)
    lookup = proposer(sched, PromptLookup(1, 4))
    lookup.__enter__()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        p = [int(t) for t in np.random.default_rng(6).permutation(470)]
        want = reference(sched, p).tokens
        for extra in ({}, {"speculative": False}):
            r = client.completions.create(model="k3-spec", prompt=p, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True, "return_token_ids": True, **extra})
            assert r.choices[0].model_extra["token_ids"] == want
            assert r.usage.completion_tokens == 24
        drafted = [q.spec.drafted for q in done if len(q.prompt) == 470][-2:]      # after the reference run
        assert drafted[0] >= 5 * K and drafted[1] == 0, drafted
        text = httpx.get(srv.url + "/metrics").text
        for name in ("k3jax_spec_draft_tokens_total", "k3jax_spec_accepted_tokens_total", "k3jax_spec_rounds_total",
                     "k3jax_spec_acceptance_rate", "k3jax_spec_mean_accepted_length", "k3jax_spec_fallback_steps"):
            assert name in text, name
        bad = httpx.post(srv.url + "/v1/completions", json={"prompt": [5, 6], "speculative": "yes"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative"
    finally:
        lookup.__exit__()
        sched.finish_hooks.remove(done.append)
        srv.stop()


# ------------------------------------------------------------------------------------------------ draft model
def test_draft_model_speculation_is_exact(model):
    """A draft model (2 layers, KDA + MLA, random weights) on its own slot-pool cache over the target's page table,
    caught up after the prompt and after a prefix-cache hit. Greedy: the output is plain greedy's (a random draft
    is rarely right). Sampled at temperature 1, where two random models' distributions are both near uniform, most
    drafts are accepted and some are not: both models' KDA layers are replayed to every length; the same request
    run again (the same rounds) gives the same tokens."""
    cfg = model.config
    lac = dataclasses.replace(cfg.linear_attn_config, kda_layers=[1], full_attn_layers=[2])
    draft = K3ForCausalLM(cfg.replace(num_hidden_layers=2, linear_attn_config=lac, first_k_dense_replace=2),
                          rngs=nnx.Rngs(5))
    s = Scheduler(model, EngineConfig(max_slots=2, max_model_len=MAX_LEN, page_size=PAGE, chunk=CHUNK,
                                      prefix_cache_block=BLOCK, record_logits=True,
                                      speculative=SpecConfig("draft", K, draft="small", adaptive=False)),
                  draft_model=draft)
    assert s.warmup()["speculative"] == [[2, K + 1]]
    s.start()
    try:
        shared = tokens(50, 140)
        prompts = [shared + tokens(51, 10), shared + tokens(52, 30)]     # the second hits 128 tokens
        for i, p in enumerate(prompts):
            ref = s.submit(p, SamplingParams(max_tokens=16, ignore_eos=True), use_speculative=False,
                           use_prefix_cache=False)
            ref.result(timeout=300)
            r = s.submit(p, SamplingParams(max_tokens=16, ignore_eos=True))
            r.result(timeout=300)
            assert r.tokens == ref.tokens and r.spec.drafted > 0
            assert max(float(np.abs(a - b).max()) for a, b in zip(r.logits, ref.logits)) <= 1e-5
            assert r.cached_tokens == (128 if i else 0)
        sampled = []
        for _ in range(2):
            r = s.submit(prompts[0], SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=3),
                         use_prefix_cache=False)
            r.result(timeout=300)
            sampled.append(r)
        assert sampled[0].tokens == sampled[1].tokens
        assert 0 < sampled[0].spec.accepted < sampled[0].spec.drafted, (sampled[0].spec.drafted,
                                                                          sampled[0].spec.accepted)
        snap = s.call(s.snapshot)
        assert snap["compiles"]["spec"] == 1 and snap["spec"]["draft_prefill_chunks"] >= 2
        assert s.memory()["draft_state_bytes_per_slot"] == slot_state_bytes(draft.config)
    finally:
        s.close()


def test_cli_generate_with_speculation(sched, capsys, tmp_path):
    """``k3jax generate --speculative ngram:2`` (the serving scheduler in the foreground) prints the acceptance
    figures and returns the plain greedy answer (the module's model has the weights the CLI loads)."""
    import json

    from k3jax.cli import main
    from k3jax.text.tokenizer import load_tokenizer

    out = tmp_path / "g.json"
    argv = ["generate", "--model", "test", "--prompt", "abcabcabcabc", "--max-new-tokens", "10", "--ignore-eos",
            "--chunk", "32", "--no-stream", "--json", str(out)]
    assert main(argv + ["--speculative", "ngram:2"]) == 0
    text = capsys.readouterr().out
    assert "speculative: n-gram prompt lookup, k=2" in text and "drafted" in text, text
    tok = load_tokenizer(None)
    assert json.loads(out.read_text())["tokens"][0] == reference(sched, [tok.bos_id] + tok.encode("abcabcabcabc"),
                                                                 10).tokens
    assert main(argv + ["--speculative", "ngram:0"]) == 2
    assert "k (drafted tokens per round)" in capsys.readouterr().out
