"""The engine's host policy without a model: the slot pool, admission, chunking, preemption, prefix-cache lookup,
registration and eviction, speculation's bookkeeping, cancellation and the queue — the :class:`Scheduler` driven
synchronously over :class:`FakeRunner`, a stand-in with the runner's interface whose "model" is a closed form
(nothing is compiled). After every step the slot pool's and the prefix index's invariants are checked."""

import numpy as np
import pytest

from k3jax import K3Config
from k3jax.infer import EngineConfig, EngineConfigError, QueueFull, RequestError, SamplingParams, Scheduler
from k3jax.infer.plan import StepOutput
from k3jax.infer.prefix_cache import KDACheckpoint, PrefixCache
from k3jax.infer.proposers import FunctionProposer
from k3jax.infer.requests import DONE
from k3jax.infer.slots import PageAllocator, SlotPool
from k3jax.infer.speculative import SpecConfig

CFG = K3Config.from_preset("test")          # a host object: vocab 512, max_position_embeddings 4096
V = CFG.vocab_size


def nxt(token: int, pos: int) -> int:
    """The fake model: the token after ``token`` at position ``pos`` (a function of both only, so a sequence
    recomputed after a preemption continues exactly as it would have)."""
    return (int(token) * 31 + int(pos) * 7 + 3) % V


def chain(prompt: list[int], n: int) -> list[int]:
    """What the fake model generates greedily after ``prompt`` (n tokens)."""
    out, last, pos = [], prompt[-1], len(prompt) - 1
    for _ in range(n):
        last = nxt(last, pos)
        pos += 1
        out.append(last)
    return out


class FakeRunner:
    """:class:`~k3jax.infer.runner.ModelRunner`'s interface over :func:`nxt`: decode rows and chunks give the closed
    form's next token; a round accepts the leading drafts equal to it; a checkpoint's "logits" hold the next token
    itself. Every executed plan is kept."""

    def __init__(self, config: EngineConfig):
        self.cfg, self.sizes = CFG, config.sizes(CFG)
        self.k = config.speculative.k if config.speculative else 0
        self.traces, self.encoder, self.plans = {}, None, []

    def checkpoint_bytes(self) -> int:
        return 1000

    def memory(self) -> dict:
        return {}

    def warmup(self, shapes) -> dict:
        self.shapes = list(shapes)
        return {}

    def execute(self, plan) -> StepOutput:
        self.plans.append(plan)
        out, after = StepOutput(), {}
        if plan.rows is not None:
            r = plan.rows
            b, T = r.size, 1 + (r.drafts.shape[1] if r.verify else 0)
            out.tokens, out.kept = np.zeros((b, T), np.int32), np.zeros(b, np.int32)
            for j in np.flatnonzero(r.active):
                L, last, emitted = int(plan.lengths[r.slots[j]]), int(r.tokens[j]), []
                drafts = list(r.drafts[j, :r.n_draft[j]]) if r.verify else []
                while True:
                    t = nxt(last, L + len(emitted))
                    emitted.append(t)
                    if len(emitted) > len(drafts) or drafts[len(emitted) - 1] != t:
                        break
                    last = t
                out.tokens[j, :len(emitted)], out.kept[j] = emitted, len(emitted)
                after[int(r.slots[j])] = (L + len(emitted), emitted[-1])
            out.banned_changed = np.zeros(b, bool)
        if plan.chunk is not None:
            c = plan.chunk
            out.chunk_token = nxt(c.ids[c.n - 1], c.start + c.n - 1)
            out.banned_changed = np.concatenate([out.banned_changed if out.banned_changed is not None else [], [False]])
            after[c.slot] = (c.start + c.n, out.chunk_token)
        for slot, logits, _ in plan.samples:
            out.sampled[slot] = int(logits)
        for slot, at in plan.saves:
            if slot in after and after[slot][0] == at:
                out.checkpoints[slot] = KDACheckpoint(("rows", slot, at), np.int64(after[slot][1]), 1000)
        return out


def compiled(s: Scheduler, plan) -> bool:
    """Whether the runner runs ``plan`` with programs warm-up compiles (a round beside a chunk: two forwards)."""
    kind, b, C = plan.shape()
    shapes = set(s.step_shapes())
    if kind == "verify" and C:
        return (kind, b, 0) in shapes and (None, 0, C) in shapes
    return (kind, b, C) in shapes


def make(**kw) -> Scheduler:
    cfg = EngineConfig(**{"max_slots": 4, "max_model_len": 512, "page_size": 16, "chunk": 64, **kw})
    s = Scheduler(runner=FakeRunner(cfg), config=cfg)
    s.step_hooks.append(s.check)
    return s


def run(s: Scheduler, reqs, limit: int = 2000) -> None:
    for _ in range(limit):
        if all(r.state == DONE for r in reqs):
            return
        s.step()
    raise AssertionError("the scheduler did not finish")


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, V, n)]


# ------------------------------------------------------------------------------------------- the slot pool
def test_slot_pool_pages_pins_and_copy_on_write():
    pool = SlotPool(2, page_size=4, num_pages=6, max_pages=4)
    shared = pool.take_pages(2)
    pool.assign(1, "a", shared, pool.take_pages(1), length=8, pin="node")
    pool.alloc.release(shared)                                 # the caller's own references go: the slot holds them
    assert pool.pages[1] == shared + [2] and list(pool.table[1, :3]) == shared + [2] and pool.lengths[1] == 8
    assert pool.grow(1, 13) and len(pool.pages[1]) == 4        # 13 tokens: 4 pages of 4
    with pytest.raises(RuntimeError, match="the table holds 4"):
        pool.grow(1, 17)                                       # past max_pages: a caller's bug, not a wait
    pool.assign(0, "b", [], pool.take_pages(1), length=0)
    assert pool.free_pages == 1 and pool.grow(0, 5) and not pool.grow(0, 9) and len(pool.pages[0]) == 2
    pool.check()
    pool.release(0)
    new = pool.alloc.alloc(1)[0]
    old = pool.replace_page(1, 1, new)
    assert old == shared[1] and pool.table[1, 1] == new
    pool.alloc.release([old])                                  # the slot's reference on the old page, handed over
    pool.check()
    assert pool.release(1) == "node" and pool.free_pages == 6 and pool.used() == 0
    pool.check()
    a = PageAllocator(2)
    with pytest.raises(RuntimeError, match="released more often"):
        a.release([0])


def test_reclaim_is_asked_before_a_page_request_fails():
    pool = SlotPool(1, page_size=4, num_pages=2, max_pages=2)
    held = pool.alloc.alloc(2)
    asked = []

    def reclaim(n):
        asked.append(n)
        pool.alloc.release(held[:n])
        return True

    pool.reclaim = reclaim
    assert pool.take_pages(1) is not None and asked == [1]


# --------------------------------------------------------------------------------------------- admission
def test_requests_finish_with_the_closed_form_answer_and_everything_is_freed():
    s = make()
    reqs = [s.submit(tokens(i, n), greedy(m)) for i, (n, m) in enumerate([(1, 5), (40, 9), (100, 3), (7, 20),
                                                                        (64, 1), (130, 4)])]
    run(s, reqs)
    for r in reqs:
        assert r.tokens == chain(r.prompt, r.params.max_tokens) and r.finish_reason == "length"
    snap = s.snapshot()
    assert snap["slots_in_use"] == 0 and snap["queue_length"] == 0 and snap["requests_live"] == 0
    assert snap["free_pages"] + snap["prefix"]["cached_pages"] == snap["num_pages"]


def test_chunks_follow_the_budget_and_mix_with_decode_rows():
    """Alone, a prompt takes the largest bucket that covers it; while others decode, chunks take what the budget
    leaves (64 − decoding rows → the 16-token bucket) and ride in the same step as the decode rows."""
    s = make(prefix_cache=False)
    a = s.submit(tokens(1, 10), greedy(30))
    s.step()                                                   # a: one 16-token chunk (10 real)
    plan = s.runner.plans[-1]
    assert plan.chunk.size == 16 and plan.chunk.n == 10 and plan.rows is None
    b = s.submit(tokens(2, 100), greedy(2))
    s.step()
    plan = s.runner.plans[-1]
    assert plan.rows is not None and plan.chunk is not None and plan.chunk.size == 16   # budget 64 − 1 row
    assert plan.chunk.slot not in plan.rows.slots[plan.rows.active]
    assert s.snapshot()["mixed_steps"] == 1
    run(s, [a, b])
    assert a.tokens == chain(a.prompt, 30) and b.tokens == chain(b.prompt, 2)
    assert all(compiled(s, p) for p in s.runner.plans if p.forward)      # only shapes warm-up compiles


def test_first_come_first_served_and_the_queue_bound():
    s = make(max_slots=2, max_queue=3, prefix_cache=False)
    reqs = [s.submit(tokens(i, 5), greedy(4)) for i in range(3)]
    with pytest.raises(QueueFull, match="max_queue"):
        s.submit([1, 2], greedy(1))
    s.step()
    assert [r.slot for r in reqs] == [0, 1, -1] and s.snapshot()["queue_length"] == 1
    run(s, reqs)
    assert reqs[2].admitted > max(reqs[0].admitted, reqs[1].admitted)


def test_preemption_takes_the_newest_and_the_answer_continues_exactly():
    """A pool too small for four long sequences: decode preempts the most recently admitted request, which goes
    back to the head of the queue and is recomputed from its prompt and tokens; every answer is the closed form."""
    s = make(num_pages=12, prefix_cache=False)                 # 12 pages of 16 tokens; 4 × 60 tokens need 16
    reqs = [s.submit(tokens(10 + i, 20), greedy(40)) for i in range(4)]
    preempted = []
    s.finish_hooks.append(lambda r: preempted.append((r.id, r.preemptions)))
    run(s, reqs)
    assert s.snapshot()["preemptions"] > 0
    assert max(p for _, p in preempted) > 0
    for r in reqs:
        assert r.tokens == chain(r.prompt, 40), r.id
    assert s.snapshot()["free_pages"] == 12


def test_cancel_frees_the_slot_and_pages_at_the_next_step():
    s = make(prefix_cache=False)
    r = s.submit(tokens(3, 30), greedy(100))
    for _ in range(4):
        s.step()
    s.cancel(r)
    s.step()
    assert r.finish_reason == "abort" and r.slot == -1
    snap = s.snapshot()
    assert snap["slots_in_use"] == 0 and snap["free_pages"] == snap["num_pages"] and snap["requests_live"] == 0
    assert list(r.stream(timeout=1))[-1].finish_reason == "abort"


def test_bad_requests_and_options_name_the_field():
    s = make()
    for kw, field in [(dict(prompt=[]), "prompt"), (dict(prompt=[V]), "prompt"), (dict(prompt=[1] * 600), "prompt"),
                      (dict(prompt=[1] * 500, params=greedy(20)), "max_tokens"),
                      (dict(prompt=[1], params=SamplingParams(stop_token_ids=(V,))), "stop_token_ids"),
                      (dict(prompt=[1], prediction=[-1]), "prediction"),
                      (dict(prompt=[1, 2], content_keys=[(5, b"x")]), "content_keys")]:
        with pytest.raises(RequestError) as e:
            s.submit(kw.pop("prompt"), kw.pop("params", greedy(1)), **kw)
        assert e.value.field == field, (kw, e.value)
    for kw, field in [({"max_slots": 0}, "max_slots"), ({"chunk": 40}, "chunk"), ({"page_size": "64"}, "page_size"),
                      ({"speculative": "ngram:0"}, None), ({"num_pages": 4, "kv_cache_memory": 10}, "num_pages"),
                      ({"vision_buckets": (6,)}, "vision_buckets"), ({"max_model_len": 9999}, "max_model_len")]:
        with pytest.raises((EngineConfigError, ValueError)) as e:
            EngineConfig(**kw).sizes(CFG)
        if field is not None:
            assert e.value.field == field and str(e.value).startswith(field)
    for kw, field in [({"temperature": -1}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 0}, "top_p"),
                      ({"seed": 2 ** 32}, "seed"), ({"max_tokens": 0}, "max_tokens"),
                      ({"no_repeat_ngram": -1}, "no_repeat_ngram"), ({"temperature": float("nan")}, "temperature")]:
        with pytest.raises(RequestError) as e:
            SamplingParams(**kw)
        assert e.value.field == field


# ------------------------------------------------------------------------------------------- prefix cache
def test_prefix_hits_restore_the_checkpoint_and_copy_the_partial_page():
    """Block 64, pages of 24 tokens (a boundary inside a page): the second request sharing 130 tokens starts from the
    128-token checkpoint — the plan restores it into the slot and copies the page holding tokens 120…143 — and a
    prompt cached whole gets its first token from the checkpoint's logits, with no prefill at all."""
    s = make(page_size=24, prefix_cache_block=64)
    shared = tokens(5, 130)
    a = s.submit(shared + tokens(6, 20), greedy(3))
    run(s, [a])
    b = s.submit(shared + tokens(7, 20), greedy(3))
    s.step()
    plan = s.runner.plans[-1]
    assert b.cached_tokens == 128 and [slot for slot, _ in plan.restores] == [b.slot]
    assert len(plan.copies) == 1 and plan.chunk.start == 128           # resumes at the hit
    run(s, [b])
    assert a.tokens == chain(a.prompt, 3) and b.tokens == chain(b.prompt, 3)
    c = s.submit(shared[:128], greedy(2))
    s.step()
    assert c.cached_tokens == 128 and s.runner.plans[-1].samples and s.runner.plans[-1].chunk is None
    run(s, [c])
    assert c.tokens == chain(c.prompt, 2)
    d = s.submit(shared + tokens(8, 1), greedy(1), use_prefix_cache=False)
    run(s, [d])
    assert d.cached_tokens == 0


def test_decode_registers_the_end_of_each_turn():
    """A turn whose answer crosses a block boundary in decode leaves a checkpoint there: the next turn hits it."""
    s = make(prefix_cache_block=64)
    p = tokens(9, 60)
    a = s.submit(p, greedy(10))
    run(s, [a])
    b = s.submit(p + a.tokens + tokens(10, 5), greedy(2))
    run(s, [b])
    assert b.cached_tokens == 64 and b.tokens == chain(b.prompt, 2)


def test_eviction_takes_unpinned_least_recently_used_leaves_within_the_budget():
    alloc = PageAllocator(8)
    idx = PrefixCache(alloc, block=16, page_size=16, page_bytes=10, budget=1000, stride=1)
    ck = lambda: KDACheckpoint(None, None, 100)  # noqa: E731
    chain_a = [idx.insert(b"a1", None, 16, alloc.alloc(1))]
    chain_a.append(idx.insert(b"a2", chain_a[0], 32, chain_a[0].pages + alloc.alloc(1)))
    b1 = idx.insert(b"b1", None, 16, alloc.alloc(1))
    for n in chain_a + [b1]:
        idx.attach(n, ck())
    alloc.release([0, 1, 2])                                    # only the nodes hold their pages now
    idx.pin(b1)
    idx.touch(chain_a[1])                                       # a's chain used after b1
    idx.budget = 250
    idx.enforce_budget()                                        # 330 bytes held: one node must go — a2, not pinned b1
    assert set(idx.nodes) == {b"a1", b"b1"} and idx.held_bytes() <= 250
    idx.check()
    assert not idx.make_room(8)                                 # b1 is pinned: its page cannot be reclaimed
    assert set(idx.nodes) == {b"a1", b"b1"}                     # and nothing was evicted for nothing
    idx.unpin(b1)
    assert idx.make_room(8) and not idx.nodes and alloc.free == 8


# ------------------------------------------------------------------------------------------- speculation
def test_adaptive_rounds_explore_once_then_retime_after_many_refusals():
    """Measured times make a round a loss (verify 10× a plain step): a request still tries one round while its rate
    is unknown, then decodes plainly, and after 64 refusals in a row one round runs again to re-measure — a verify
    time taken on a bad step never switches speculation off for good."""
    from k3jax.infer import spec_policy

    s = make(speculative=SpecConfig("ngram", 3, adaptive=True))
    s.spec.proposer = FunctionProposer(lambda req, n: chain(req.prompt + req.tokens, n))
    s.spec.observe = lambda key, seconds: None
    s.spec.step_seconds = {(kind, b, 0): (10.0 if kind == "verify" else 1.0) for kind in ("verify", "decode")
                           for b in s.sizes.decode}
    r = s.submit(tokens(13, 20), greedy(120))
    run(s, [r])
    c = s.spec.counters
    assert r.tokens == chain(r.prompt, 120)
    assert c["spec_retime_rounds"] == 1 and c["spec_rounds"] == 2 and r.spec.drafted == 6 and r.spec.accepted == 6
    assert c["spec_fallback_steps"] >= spec_policy._RETIME_EVERY - 1


def test_rounds_draft_within_the_limits_and_the_answer_stays_the_closed_form():
    """A proposer that is right for two drafts then wrong: rounds accept two and the answer is the closed form;
    drafts never cross a prefix-cache block boundary or max_tokens; a request with a ban never drafts."""
    s = make(speculative=SpecConfig("ngram", 3, adaptive=False), prefix_cache_block=64)
    calls = []

    def propose(req, n):
        want = chain(req.prompt + req.tokens, n)
        calls.append((len(req.prompt) + len(req.tokens), n))
        return want[:2] + [(t + 1) % V for t in want[2:]]

    s.spec.proposer = FunctionProposer(propose)
    r = s.submit(tokens(11, 50), greedy(30))
    banned = s.submit(tokens(12, 8), greedy(5, no_repeat_ngram=2))
    run(s, [r, banned])
    assert r.tokens == chain(r.prompt, 30) and r.spec.drafted > 0 and r.spec.accepted > 0
    for held, n in calls:                                       # the slot held `held - 1` tokens (its last one pending)
        L = held - 1
        assert n <= 3 and L + n + 1 <= (L // 64 + 1) * 64       # never past the next block boundary
    assert banned.spec.drafted == 0
    verify = [p for p in s.runner.plans if p.rows is not None and p.rows.verify]
    assert verify and all(compiled(s, p) for p in verify)
