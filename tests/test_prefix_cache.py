"""The KDA-aware prefix cache: a request served from the cache gives exactly the tokens (greedy) and the logits
(≤ 1e-5, fp32) of the same request with the cache off, on the ``test`` preset (3 KDA + 2 MLA layers, every K3
feature). One scheduler (4 slots, 96-token pages so 512-token blocks end inside a page and partial pages are
copied on write, ``prefix_verify`` on: every hit is also recomputed from scratch through the contiguous cache) runs
on its thread for the whole module; after every step the index's and the slot pool's invariants are checked
(``Scheduler.check``). The tests change engine state only through ``Scheduler.call`` (on the scheduler thread)."""

import time

import numpy as np
import pytest
from flax import nnx

from k3jax import K3Config, K3ForCausalLM
from k3jax.infer import EngineConfig
from k3jax.infer.prefix_cache import block_hashes
from k3jax.infer.scheduler import SamplingParams, Scheduler

PAGE, BLOCK, MAX_LEN = 96, 512, 2048


@pytest.fixture(scope="module")
def sched():
    cfg = K3Config.from_preset("test")
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(3))
    s = Scheduler(model, EngineConfig(max_slots=4, max_model_len=MAX_LEN, page_size=PAGE, chunk=128,
                                      record_logits=True, prefix_cache_verify=True, prefix_cache_stride=4))
    s.warmup()
    errors = []

    def check():
        try:
            s.check(exact=False)                      # the tests hold pages of the pool themselves at times
        except AssertionError as e:  # recorded: the scheduler thread would only log it
            errors.append(repr(e))
            raise
    s.step_hooks.append(check)
    s.start()
    s.errors = errors
    yield s
    s.close()
    assert not errors


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def run(sched, prompt, n=4, cache=True):
    r = sched.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True), use_prefix_cache=cache)
    r.result(timeout=300)
    assert r.finish_reason == "length", (r.finish_reason, r.error)
    return r


_refs: dict = {}


def reference(sched, prompt, n=4):
    """The same request with the prefix cache off (memoised per prompt)."""
    key = (tuple(prompt), n)
    if key not in _refs:
        _refs[key] = run(sched, prompt, n, cache=False)
    return _refs[key]


def assert_same(sched, r, n=4):
    ref = reference(sched, r.prompt, n)
    assert r.tokens == ref.tokens
    err = max(float(np.abs(a - b).max()) for a, b in zip(r.logits, ref.logits))
    assert err <= 1e-5, err
    assert len(r.logits) == len(ref.logits) == n


def verified(sched) -> dict:
    s = sched.call(lambda: dict(sched.prefix.index.stats))
    assert s["verify_failures"] == 0, sched.prefix.verify_log[-3:]
    return s


# prefix length L → cached tokens of (B, C, D): A = P + 150 own tokens (miss), B and C = P + 150 others, D = P alone
EXPECTED = {511: (0, 0, 0),            # no whole block shared
            512: (512, 512, 512),      # A's last boundary is the prefix's end; D is served entirely from the cache
            513: (512, 512, 512),
            908: (0, 512, 512),        # A's last boundary (1024) lies in its own tokens: B saves the branch point
            960: (0, 512, 512),        # an exact multiple of the page size (10 × 96)
            1024: (1024, 1024, 1024),
            1536: (1536, 1536, 1536)}


@pytest.mark.parametrize("L", sorted(EXPECTED))
def test_shared_prefix_of_each_length_hits_exactly(sched, L):
    P = tokens(L, L)
    got = []
    for who in "ABCD":
        prompt = P + (tokens(L * 10 + ord(who), 150) if who != "D" else [])
        r = run(sched, prompt)
        got.append(r.cached_tokens)
        assert_same(sched, r)
    assert tuple(got) == (0,) + EXPECTED[L], got
    verified(sched)


def test_multi_turn_chat_hits_the_end_of_each_turn(sched):
    """Turn n+1's prompt extends turn n's prompt and answer; the checkpoint decode saved when the answer crossed a
    block boundary is what turn n+1 starts from."""
    prompt, cached = tokens(1, 480), []
    for turn in range(3):
        r = run(sched, prompt, n=40)
        assert_same(sched, r, n=40)
        cached.append(r.cached_tokens)
        prompt = prompt + r.tokens + tokens(100 + turn, 480 if turn == 0 else 100)
    # turn 1: 480 + 40 crosses 512 in decode; turn 2 (1000 tokens) + 40 crosses 1024 in decode
    assert cached == [0, 512, 1024]
    verified(sched)


def test_two_requests_racing_on_one_prefix(sched):
    P = tokens(7, 1100)
    a_prompt, b_prompt = P + tokens(70, 60), P + tokens(71, 60)
    with sched.batched():                             # both reach the scheduler in the same step
        a = sched.submit(a_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        b = sched.submit(b_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    a.result(timeout=300), b.result(timeout=300)
    assert (a.cached_tokens, b.cached_tokens) == (0, 0)
    for r in (a, b):
        assert_same(sched, r)
    c = run(sched, P + tokens(72, 60))
    assert c.cached_tokens == 1024
    assert_same(sched, c)
    # one node per boundary whatever the race: the keys are the two prompts' chains, no duplicates
    keys = set(block_hashes(a_prompt, BLOCK)) | set(block_hashes(b_prompt, BLOCK))
    assert keys <= sched.call(lambda: set(sched.prefix.index.nodes))
    verified(sched)


def wait_idle(sched, timeout=60.0):
    deadline = time.monotonic() + timeout
    while sched.busy():
        assert time.monotonic() < deadline, "scheduler did not go idle"
        time.sleep(0.01)


def test_eviction_under_a_tiny_budget_and_a_small_pool(sched):
    """Budget for one checkpoint and a few pages, and most of the page pool held back, so cached prefixes are
    evicted (for the budget and for live requests' pages): every answer still equals the uncached one and the
    budget holds after every step (unless all that is left is pinned)."""
    wait_idle(sched)
    P, alloc = sched.prefix.index, sched.pool.alloc
    old_budget = P.budget
    over = []
    hook = lambda: over.append(P.held_bytes() - P.budget) if P.held_bytes() > P.budget and P.evictable() else None  # noqa: E731

    def squeeze():
        P.clear()
        P.budget = sched.runner.checkpoint_bytes() + 8 * P.page_bytes
        sched.step_hooks.append(hook)
        return alloc.alloc(alloc.free - 40)                # 40 pages (3840 tokens) left for everything

    held = sched.call(squeeze)
    ev0 = P.stats["evictions"]
    try:
        roots = [tokens(900 + i, 1100) for i in range(3)]
        prompts = [roots[i % 3] + tokens(950 + i, 80) for i in range(9)]
        reqs = []
        for k in range(0, 9, 3):
            with sched.batched():
                reqs += [sched.submit(p, SamplingParams(max_tokens=4, ignore_eos=True)) for p in prompts[k:k + 3]]
            for r in reqs[-3:]:
                r.result(timeout=300)
        wait_idle(sched)
    finally:
        def restore():
            sched.step_hooks.remove(hook)
            alloc.release(held)
            P.budget = old_budget
        sched.call(restore)
    assert not over, over[:5]
    assert sched.call(lambda: P.stats["evictions"]) > ev0
    for r in reqs:
        assert_same(sched, r)
    verified(sched)


def test_random_workloads_never_restore_a_state_without_its_pages(sched):
    """Random prefixes of three long roots, random suffixes, random batch sizes, a random small budget and pool:
    the invariants hold after every step (every node's pages are held and not free, its parent cached), every hit
    verifies against its recomputation, every answer equals the uncached one."""
    wait_idle(sched)
    P, alloc = sched.prefix.index, sched.pool.alloc
    rng = np.random.default_rng(11)
    roots = [tokens(700 + i, 1400) for i in range(3)]
    old_budget = P.budget
    reqs = []
    for round_ in range(3):
        budget = int(rng.integers(1, 4)) * sched.runner.checkpoint_bytes() + int(rng.integers(4, 30)) * P.page_bytes
        keep = int(rng.integers(36, 60))

        def squeeze():
            P.budget = budget
            return alloc.alloc(alloc.free - keep)

        held = sched.call(squeeze)
        try:
            for _ in range(2):
                batch = []
                for _ in range(int(rng.integers(1, 5))):
                    root = roots[int(rng.integers(3))]
                    cut = int(rng.integers(300, 1400))
                    batch.append(root[:cut] + tokens(int(rng.integers(10 ** 6)), int(rng.integers(1, 200))))
                with sched.batched():
                    reqs += [sched.submit(p, SamplingParams(max_tokens=3, ignore_eos=True)) for p in batch]
                for r in reqs[-len(batch):]:
                    r.result(timeout=300)
            wait_idle(sched)
        finally:
            sched.call(lambda: alloc.release(held))
    sched.call(lambda: setattr(P, "budget", old_budget))
    assert sum(r.cached_tokens > 0 for r in reqs) >= 3
    for r in reqs:
        assert_same(sched, r, n=3)
    nodes = sched.call(lambda: [(list(n.pages), [alloc.is_free(p) for p in n.pages]) for n in P.nodes.values()])
    for pages, free in nodes:
        assert not any(free), pages
    verified(sched)


def test_verify_catches_a_corrupted_checkpoint_and_loses_nothing(sched):
    P0 = tokens(31, 700)
    first = run(sched, P0 + tokens(32, 20))
    wait_idle(sched)
    P = sched.prefix.index

    def corrupt():
        node = P.nodes[block_hashes(P0, BLOCK)[0]]
        ck = node.checkpoint
        rows = tuple(type(r)(r.state + 1.0, r.conv_q, r.conv_k, r.conv_v) for r in ck.rows)
        node.checkpoint = type(ck)(rows, ck.logits, ck.nbytes)
        return node, P.stats["verify_failures"]

    node, fails = sched.call(corrupt)
    r = run(sched, P0 + tokens(33, 20))
    assert sched.call(lambda: P.stats["verify_failures"]) == fails + 1
    assert r.cached_tokens == 0                       # the bad checkpoint was dropped, the request recomputed
    assert_same(sched, r)
    assert first.cached_tokens == 0
    assert sched.call(lambda: P.nodes.get(block_hashes(P0, BLOCK)[0])) is not node
    sched.call(lambda: P.stats.update(verify_failures=fails))   # the module's teardown checks for unexpected failures


def test_snapshot_and_memory_report_the_cache(sched):
    prompt = tokens(71, BLOCK + 40)                   # a miss, then a hit of its first block: stands alone
    run(sched, prompt)
    run(sched, prompt)
    wait_idle(sched)
    snap = sched.call(lambda: sched.snapshot())["prefix"]
    for k in ("lookups", "hits", "hit_tokens", "queried_tokens", "hit_rate", "checkpoint_bytes", "evictions",
              "checkpoints", "cached_pages", "budget_bytes"):
        assert k in snap
    assert snap["lookups"] > 0 and 0 < snap["hit_rate"] < 1
    mem = sched.memory()
    # a checkpoint = every KDA layer's fp32 state [H, K, V] + three conv windows [W-1, H*K] + the logits [V]
    cfg = sched.cfg
    lac = cfg.linear_attn_config
    H, D, W = lac.num_heads, lac.head_dim, lac.short_conv_kernel_size
    per_layer = H * D * D * 4 + 3 * (W - 1) * H * D * 4
    assert mem["prefix_checkpoint_bytes"] == len(lac.kda_layers) * per_layer + cfg.vocab_size * 4
    # prefill chunks (32, 128), decode (4 slots), decode rows + a 32-token chunk in one forward, and the prefix
    # cache's save / restore / page copy / sample-from-logits / from-scratch verify programs: nothing else compiled
    assert sched.snapshot()["compiles"] == {"prefill": 2, "decode": 1, "decode+prefill": 1, "prefix": 5}


def test_bad_content_keys_are_refused(sched):
    from k3jax.infer.scheduler import RequestError
    with pytest.raises(RequestError, match="content_keys"):
        sched.submit([5, 6, 7], SamplingParams(max_tokens=1), content_keys=[(9, b"x")])


def test_content_keys_change_the_chain():
    ids = tokens(5, 1100)
    plain = block_hashes(ids, BLOCK)
    img = block_hashes(ids, BLOCK, [(600, b"image-a")])
    other = block_hashes(ids, BLOCK, [(600, b"image-b")])
    assert plain[0] == img[0] == other[0]               # the block before the image is shared
    assert len({plain[1], img[1], other[1]}) == 3       # from the image's block on, the content decides
    assert block_hashes(ids, 256) != plain and len(block_hashes(ids, 256)) == 4


def test_server_reports_cached_tokens_and_prefix_metrics(sched, tmp_path):
    """``usage.prompt_tokens_details.cached_tokens`` (official ``openai`` client, loopback) and the
    ``k3jax_prefix_cache_*`` series of ``/metrics``, from an app over the module's scheduler."""
    import re

    import httpx
    import openai

    from k3jax.serve.app import ServeConfig, create_app
    from k3jax.serve.server import Server, free_port
    from k3jax.text.tokenizer import TiktokenTokenizer
    from tokenizer_fixture import write_release_tokenizer

    write_release_tokenizer(tmp_path)
    app = create_app(sched, TiktokenTokenizer(tmp_path),
                     ServeConfig(model_name="k3-test", max_model_len=MAX_LEN, own_scheduler=False))
    srv = Server(sched, None, app, "127.0.0.1", free_port(), "k3-test").start_background()
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
        P = [t % 256 for t in tokens(55, 700)]          # ordinary ids of the fixture tokenizer
        outs = [client.completions.create(model="k3-test", prompt=P + [10 + i] * 20, max_tokens=3, temperature=0,
                                          extra_body={"ignore_eos": True}) for i in range(2)]
        assert [o.usage.prompt_tokens_details.cached_tokens for o in outs] == [0, 512]
        assert outs[1].usage.prompt_tokens == 720
        stream = client.completions.create(model="k3-test", prompt=P + [40] * 20, max_tokens=3, temperature=0,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"ignore_eos": True})
        usage = [c.usage for c in stream if c.usage is not None]
        assert usage[-1].prompt_tokens_details.cached_tokens == 512
        text = httpx.get(srv.url + "/metrics").text
        values = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(k3jax_prefix_cache_\w+) ([0-9.e+-]+)$",
                                                                      text, re.M)}
        for name in ("lookups_total", "hits_total", "hit_tokens_total", "queried_tokens_total", "evictions_total",
                     "hit_rate", "checkpoint_bytes", "checkpoints", "cached_pages", "budget_bytes"):
            assert f"k3jax_prefix_cache_{name}" in values, name
        snap = sched.call(sched.prefix.index.snapshot)
        assert values["k3jax_prefix_cache_hit_tokens_total"] == snap["hit_tokens"]
        assert values["k3jax_prefix_cache_checkpoint_bytes"] == snap["checkpoint_bytes"] > 0
    finally:
        srv.stop()


def test_image_content_is_in_the_key(sched):
    """Images (K3_VISION_SPEC): the same image in the same place hits — verified against a from-scratch prefill with
    the image rows spliced in — and gives the same tokens; another image behind the same ids misses. A random tiny
    vision tower (spec §11 sizes) in front of this module's scheduler; the prompt's one 112×70 image is 12 tokens."""
    import jax

    from k3jax.nn.layers import KeyGen
    from k3jax.vision import VisionConfig, VisionEncoder, process_image, splice_prompt
    from k3jax.vision.tower import Projector, VisionTower
    from make_vision_fixture import TINY_VISION_CONFIG

    vc = VisionConfig.from_dict(dict(TINY_VISION_CONFIG, text_hidden_size=sched.cfg.hidden_size))
    keys = KeyGen(jax.random.key(2))
    enc = VisionEncoder(VisionTower(vc, keys=keys), Projector(vc, keys=keys))
    pad = 277                                                        # <|media_pad|> of the release-layout fixture
    ids = [t if t != pad else pad + 1 for t in tokens(80, 30)] + [pad] + \
        [t if t != pad else pad + 1 for t in tokens(81, 520)]
    pics = [process_image(np.random.default_rng(s).integers(0, 256, (70, 112, 3), dtype=np.uint8)) for s in (1, 2)]
    a, b = (splice_prompt(ids, enc.encode([p]), pad, [p.digest]) for p in pics)
    assert a.ids == b.ids and len(a.ids) == len(ids) + 11 > BLOCK
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    failures = sched.call(lambda: sched.prefix.index.stats["verify_failures"])
    r1 = sched.submit(None, params, embeds=a)
    r1.result()
    r2 = sched.submit(None, params, embeds=a)
    r2.result()
    r3 = sched.submit(None, params, embeds=b)
    r3.result()
    assert (r1.cached_tokens, r2.cached_tokens, r3.cached_tokens) == (0, BLOCK, 0)
    assert r2.tokens == r1.tokens and sched.call(lambda: sched.prefix.index.stats["verify_failures"]) == failures
    assert not sched.errors
