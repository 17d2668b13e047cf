"""``k3jax serve``: the OpenAI API over the continuous-batching scheduler, driven with the official ``openai`` client
and ``httpx`` over loopback. One server (the ``test`` preset with a release-layout tokenizer, 4 slots, a page pool
too small for four long sequences, so the load test preempts) is compiled once and shared by the module; every
greedy answer is compared with ``k3jax.generate`` on the same prompt alone."""

import asyncio
import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import httpx
import numpy as np
import openai
import pytest
from flax import nnx

import k3jax
from k3jax import K3Config, K3ForCausalLM
from k3jax.infer import EngineConfig
from k3jax.infer.scheduler import QueueFull, RequestError, SamplingParams
from k3jax.nn.cache import page_bytes
import k3jax.text.stream as stream_module
from k3jax.serve.app import ServeConfig, create_app
from k3jax.serve.server import Server, ServerOptions, build_server, free_port
from k3jax.text.chat import encode_chat, parse_assistant
from k3jax.text.tokenizer import TiktokenTokenizer
from tokenizer_fixture import CHAT_IDS, write_release_tokenizer

EOM = CHAT_IDS["<|end_of_msg|>"]          # 258: the config's eos_token_id, as in the release (not [EOS])
PAGE, PAGES, SLOTS, MAX_LEN = 32, 16, 4, 512


def tiny_encoder(hidden: int):
    """A random tiny vision tower (spec §11 sizes) projecting to the text model's width."""
    import jax

    from k3jax.nn.layers import KeyGen
    from k3jax.vision import VisionConfig, VisionEncoder
    from k3jax.vision.tower import Projector, VisionTower
    from make_vision_fixture import TINY_VISION_CONFIG

    vc = VisionConfig.from_dict(dict(TINY_VISION_CONFIG, text_hidden_size=hidden))
    keys = KeyGen(jax.random.key(5))
    return VisionEncoder(VisionTower(vc, keys=keys), Projector(vc, keys=keys))


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The module's server. Its engine has a vision encoder, but its app no image policy (images are refused
    there: ``seeing`` is the app that takes them)."""
    d = tmp_path_factory.mktemp("tokenizer")
    write_release_tokenizer(d)
    tok = TiktokenTokenizer(d)
    cfg = K3Config.from_preset("test").replace(bos_token_id=CHAT_IDS["[BOS]"], eos_token_id=EOM,
                                               pad_token_id=CHAT_IDS["[PAD]"])
    model = K3ForCausalLM(cfg, rngs=nnx.Rngs(7))
    encoder = tiny_encoder(cfg.hidden_size)
    engine = EngineConfig(max_slots=SLOTS, max_model_len=MAX_LEN, chunk=64, page_size=PAGE, max_queue=64,
                          kv_cache_memory=PAGES * PAGE * page_bytes(cfg), vision_buckets=(64,))
    srv = build_server(model, engine, ServerOptions(port=0, served_model_name="k3-test"), tokenizer=tok,
                       encoder=encoder, pad_id=CHAT_IDS["<|media_pad|>"], say=lambda s: None)
    finished = []
    srv.scheduler.finish_hooks.append(lambda r: finished.append((r.id, r.finish_reason, len(r.tokens))))
    srv.start_background()
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
    yield types.SimpleNamespace(srv=srv, url=srv.url, model=model, tok=tok, cfg=cfg, client=client,
                                finished=finished, encoder=encoder)
    srv.stop()


@functools.lru_cache(maxsize=None)
def _offline(model, prompt: tuple, n: int) -> tuple:
    return tuple(k3jax.generate(model, list(prompt), n, stop_tokens=[EOM]))


def offline(served, prompt, n):
    """What ``k3jax.generate`` returns for ``prompt`` alone (greedy, stopping on the config's eos)."""
    return list(_offline(served.model, tuple(int(t) for t in prompt), n))


def metrics(url) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(k3jax_[a-z_]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_idle(url, timeout=30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["k3jax_slots_in_use"] == 0 and m["k3jax_free_pages"] == m["k3jax_num_pages"]
                and m["k3jax_queue_length"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_completions_with_the_openai_client(served):
    c, tok = served.client, served.tok
    r = c.completions.create(model="k3-test", prompt="def main():", max_tokens=12, temperature=0,
                             extra_body={"return_token_ids": True})
    ids = [tok.bos_id] + tok.encode_ordinary("def main():")
    want = offline(served, ids, 12)
    ch = r.choices[0]
    assert ch.token_ids == want and ch.prompt_token_ids == ids
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want)
    assert r.usage.total_tokens == len(ids) + len(want)
    assert ch.finish_reason == ("stop" if want[-1] == EOM else "length")
    text = tok.decode([t for t in want if t != EOM])
    assert ch.text == text
    # token-id prompt, streamed: the chunks add up to the same text, usage in the last chunk
    chunks = list(c.completions.create(model="k3-test", prompt=ids, max_tokens=12, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(x.choices[0].text for x in chunks if x.choices) == text
    assert [x.choices[0].finish_reason for x in chunks if x.choices][-1] == ch.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want) and chunks[-1].usage.prompt_tokens == len(ids)
    # a stop string cuts the text before it (streamed or not); a stop token id ends at that token
    probe = c.completions.create(model="k3-test", prompt=ids, max_tokens=24, temperature=0,
                                 extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    full, gen = probe.text, probe.token_ids
    assert len(gen) == 24
    stop = full[5:7]
    cut = full[:full.find(stop)]
    for stream in (False, True):
        res = c.completions.create(model="k3-test", prompt=ids, max_tokens=24, temperature=0, stop=[stop, "\x00zz"],
                                   stream=stream, extra_body={"ignore_eos": True})
        res = list(res) if stream else res
        got = "".join(x.choices[0].text for x in res) if stream else res.choices[0].text
        reason = [x.choices[0].finish_reason for x in res][-1] if stream else res.choices[0].finish_reason
        assert (got, reason) == (cut, "stop")
    r = c.completions.create(model="k3-test", prompt=ids, max_tokens=24, temperature=0,
                             extra_body={"return_token_ids": True, "ignore_eos": True, "stop_token_ids": [gen[4]]})
    assert r.choices[0].token_ids == gen[:gen.index(gen[4]) + 1] and r.choices[0].finish_reason == "stop"
    assert [m.id for m in c.models.list().data] == ["k3-test"]
    h = httpx.get(served.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == "k3-test"


def test_chat_with_the_openai_client_matches_offline_and_the_parser(served):
    c, tok = served.client, served.tok
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|open|> there"}]
    for effort, thinking in [(None, True), ("none", False), ("low", True)]:
        kw = {} if effort is None else {"reasoning_effort": effort}
        r = c.chat.completions.create(model="k3-test", messages=messages, max_tokens=10, temperature=0,
                                      extra_body={"return_token_ids": True}, **kw)
        ids = encode_chat(tok, messages, thinking=thinking, thinking_effort=(effort or "max") if thinking else None)
        # every message opens and closes; the generation prompt opens two more (message, think/response); the
        # <|open|> the user typed is text, not a marker
        assert ids.count(CHAT_IDS["<|open|>"]) == ids.count(CHAT_IDS["<|close|>"]) + 2
        want = offline(served, ids, 10)
        ch = r.choices[0]
        assert ch.prompt_token_ids == ids and ch.token_ids == want and r.usage.prompt_tokens == len(ids)
        msg = parse_assistant(tok.decode([t for t in want if t != EOM]), thinking=thinking)
        assert ch.message.content == msg.content
        assert getattr(ch.message, "reasoning_content", None) == msg.reasoning
        deltas = list(c.chat.completions.create(model="k3-test", messages=messages, max_tokens=10, temperature=0,
                                                stream=True, **kw))
        assert deltas[0].choices[0].delta.role == "assistant"
        assert "".join(d.choices[0].delta.content or "" for d in deltas) == msg.content
        assert "".join(getattr(d.choices[0].delta, "reasoning_content", None) or "" for d in deltas) == \
            (msg.reasoning or "")
        assert deltas[-1].choices[0].finish_reason == ch.finish_reason


class ScriptedTokenizer:
    """The fixture tokenizer, except that generated ids decode to a scripted reply (3 characters per id), so the
    server's reasoning / content / tool-call plumbing is checked end to end whatever the random model says; and
    a prompt containing "boom" raises (a request that fails inside the server)."""

    def __init__(self, tok, script):
        self.tok, self.script = tok, script
        for a in ("bos_id", "eos_id", "pad_id", "vocab_size", "name"):
            setattr(self, a, getattr(tok, a))

    def special_id(self, name):
        return self.tok.special_id(name)

    def encode(self, text):
        return self.tok.encode(text)

    def encode_ordinary(self, text):
        if "boom" in text:
            raise RuntimeError("injected fault")
        return self.tok.encode_ordinary(text)

    def decode(self, ids):
        return self.script[:3 * len(ids)]


SCRIPT = ("I should call the weather tool.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response"
          "<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" "
          "type=\"string\"<|sep|>Paris<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>2"
          "<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>[END]")


@pytest.fixture(scope="module")
def scripted(served):
    """A second app over the same scheduler (nothing recompiles), with the scripted tokenizer."""
    sched = served.srv.scheduler
    app = create_app(sched, ScriptedTokenizer(served.tok, SCRIPT),
                     ServeConfig(model_name="k3-test", max_model_len=MAX_LEN, own_scheduler=False))
    srv = Server(sched, None, app, "127.0.0.1", free_port(), "k3-test").start_background()
    yield types.SimpleNamespace(url=srv.url, client=openai.OpenAI(base_url=srv.url + "/v1", api_key="none",
                                                                  max_retries=0, timeout=60))
    srv.stop()


class _WholeTextDecoder(stream_module.IncrementalDecoder):
    """The server's incremental decoder with its window pinned at the start: the scripted tokenizer's text depends
    on how many ids it is given from the first one, not on the ids themselves."""

    def push(self, ids, final=False):
        out = super().push(ids, final)
        self.prefix = 0
        return out


def test_reasoning_content_and_tool_calls_come_back_apart(served, scripted, monkeypatch):
    monkeypatch.setattr(stream_module, "IncrementalDecoder", _WholeTextDecoder)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    kw = dict(model="k3-test", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools,
              max_tokens=len(SCRIPT) // 3 + 2, temperature=0, stop=["[END]"],
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"thinking_effort": None}})
    r = scripted.client.chat.completions.create(**kw)
    m = r.choices[0].message
    assert m.reasoning_content == "I should call the weather tool." and m.content == "Checking."
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = m.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    chunks = list(scripted.client.chat.completions.create(stream=True, **kw))
    text = {"content": "", "reasoning_content": ""}
    calls = []
    for ch in chunks:
        d = ch.choices[0].delta
        text["content"] += d.content or ""
        text["reasoning_content"] += getattr(d, "reasoning_content", None) or ""
        calls += d.tool_calls or []
        assert "<|" not in (d.content or "") + (getattr(d, "reasoning_content", None) or "")
    assert text == {"content": "Checking.", "reasoning_content": "I should call the weather tool."}
    assert [c.function.name for c in calls] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    # a request that raises inside the server: 500 with an error body, the server and other requests go on
    with pytest.raises(openai.InternalServerError, match="injected fault"):
        scripted.client.chat.completions.create(model="k3-test", messages=[{"role": "user", "content": "boom"}])
    assert served.client.completions.create(model="k3-test", prompt=[5, 6, 7], max_tokens=3, temperature=0,
                                            extra_body={"return_token_ids": True}).choices[0].token_ids == \
        offline(served, [5, 6, 7], 3)


def test_tokenizer_endpoints_match_the_server_tokenizer(served):
    """vLLM's /tokenize, /detokenize and /tokenizer_info: the ids a completion and a chat request are served from
    (the fixture's release tokenizer, BOS first; the chat template's rendering), their text back, the special
    tokens, and 400s naming the field."""
    from k3jax.text.chat import encode_chat

    with httpx.Client(base_url=served.url, timeout=60) as c:
        r = c.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
        assert r["tokens"] == [CHAT_IDS["[BOS]"]] + served.tok.encode("Hello there")
        assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_LEN
        assert "".join(r["token_strs"][1:]) == "Hello there"
        assert c.post("/tokenize", json={"prompt": "Hi", "add_special_tokens": False}).json()["tokens"] == \
            served.tok.encode("Hi")
        msgs = [{"role": "user", "content": "What is 2+2?"}]
        assert c.post("/tokenize", json={"messages": msgs}).json()["tokens"] == encode_chat(served.tok, msgs)
        assert c.post("/detokenize", json={"tokens": served.tok.encode("round trip")}).json() == \
            {"prompt": "round trip"}
        info = c.get("/tokenizer_info").json()
        assert (info["bos_token_id"], info["vocab_size"]) == (CHAT_IDS["[BOS]"], served.tok.vocab_size)
        assert info["bos_token"] == "[BOS]" and info["chat_template"] is not None
        for path, body, field in (("/detokenize", {"tokens": [1, 10**9]}, "tokens[1]"),
                                  ("/tokenize", {"prompt": "a", "messages": msgs}, "prompt"),
                                  ("/tokenize", {}, "prompt"),
                                  ("/tokenize", {"prompt": 3}, "prompt"),
                                  ("/detokenize", {"tokens": [1], "model": "other"}, "model")):
            r = c.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (path, body, r.text)


def test_chat_needs_a_chat_capable_tokenizer(served):
    from k3jax.text.tokenizer import ByteTokenizer

    app = create_app(served.srv.scheduler, ByteTokenizer(),
                     ServeConfig(model_name="k3-test", max_model_len=MAX_LEN, own_scheduler=False))
    srv = Server(served.srv.scheduler, None, app, "127.0.0.1", free_port(), "k3-test").start_background()
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat needs the release tokenizer" in r.json()["error"]["message"]
    finally:
        srv.stop()


def test_load_64_requests_16_clients_equal_offline_then_everything_is_free(served):
    """Mixed prompt lengths (1 token to three 64-token chunks) and output lengths, streamed and not, from 16
    concurrent clients; the 16-page pool cannot hold four long sequences, so running ones get preempted and
    recomputed — and every answer still equals offline greedy generation."""
    rng = np.random.default_rng(0)
    lens = rng.choice([1, 7, 40, 64, 65, 100, 150, 200], 64)
    outs = rng.integers(1, 49, 64)
    prompts = [rng.integers(0, 256, int(n)).tolist() for n in lens]
    before = metrics(served.url)
    aclient = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)

    async def one(i, sem):
        async with sem:
            kw = dict(model="k3-test", prompt=prompts[i], max_tokens=int(outs[i]), temperature=0,
                      extra_body={"return_token_ids": True})
            if i % 2:
                ids = []
                async for ch in await aclient.completions.create(stream=True, **kw):
                    ids += ch.choices[0].token_ids or [] if ch.choices else []
                return ids
            return (await aclient.completions.create(**kw)).choices[0].token_ids

    async def main():
        sem = asyncio.Semaphore(16)
        return await asyncio.gather(*(one(i, sem) for i in range(64)))

    got = asyncio.run(main())
    for i in range(64):
        assert got[i] == offline(served, prompts[i], int(outs[i])), f"request {i} (prompt {lens[i]} tokens)"
    after = wait_idle(served.url)
    assert after["k3jax_preemptions_total"] > before["k3jax_preemptions_total"]      # the tiny pool did preempt
    assert after["k3jax_slots_in_use"] == 0 and after["k3jax_queue_length"] == 0
    assert after["k3jax_free_pages"] == after["k3jax_num_pages"] == PAGES
    assert after['k3jax_compiles{step="decode"}'] == 1 and after['k3jax_compiles{step="prefill"}'] == 2
    assert after['k3jax_compiles{step="decode+prefill"}'] == 1 and after["k3jax_mixed_steps_total"] > 0
    assert after['k3jax_requests_total{endpoint="/v1/completions",status="200"}'] >= 64
    assert after["k3jax_time_to_first_token_seconds_count"] >= before["k3jax_time_to_first_token_seconds_count"] + 64


def test_seeded_sampling_is_reproducible(served):
    kw = dict(model="k3-test", prompt=[1, 2, 3, 4], max_tokens=12, temperature=1.0, top_p=0.9, seed=1234,
              extra_body={"return_token_ids": True, "top_k": 50, "ignore_eos": True})
    a = served.client.completions.create(**kw).choices[0].token_ids

    async def crowd():    # the same request again, among others
        ac = openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)
        others = [ac.completions.create(model="k3-test", prompt=[9] * 30, max_tokens=8, temperature=0.7)
                  for _ in range(3)]
        res = await asyncio.gather(ac.completions.create(**kw), *others)
        return res[0].choices[0].token_ids

    assert asyncio.run(crowd()) == a and len(a) == 12
    other = served.client.completions.create(**{**kw, "seed": 99}).choices[0].token_ids
    assert other != a


@pytest.mark.parametrize("body,field,fragment", [
    (b"{not json", "body", "malformed JSON"),
    ({"prompt": "x", "temperature": "hot"}, "temperature", "valid"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"model": "gpt-4", "prompt": "x"}, "model", "unknown model 'gpt-4'"),
    ({"prompt": [1] * 600}, "prompt", "max_model_len is 512"),
    ({"prompt": [1] * 400, "max_tokens": 200}, "max_tokens", "exceeds max_model_len 512"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "≥ 1"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens", "≥ 1"),
    ({"prompt": "x", "temperature": -0.5}, "temperature", "≥ 0"),
    ({"prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
    ({"prompt": "x", "top_k": -7}, "top_k", "-1 or 0"),
    ({"prompt": [1, 600]}, "prompt", "[0, 512)"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": "x", "n": 2}, "n", "n=1"),
    ({}, "prompt", "required"),
])
def test_bad_completion_requests_are_400_naming_the_field(served, body, field, fragment):
    content = body if isinstance(body, bytes) else json.dumps(body)
    r = httpx.post(served.url + "/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and fragment in err["message"], err


def test_bad_chat_requests_are_400_naming_the_field(served):
    for body, field in [({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
                        ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "medium"},
                         "reasoning_effort")]:
        r = httpx.post(served.url + "/v1/chat/completions", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_full_queue_is_429_with_retry_after(served):
    sched = served.srv.scheduler
    old = sched.max_queue
    sched.max_queue = 0
    try:
        r = httpx.post(served.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        sched.max_queue = old
    with pytest.raises(QueueFull):          # the Python API says the same
        sched.max_queue = 0
        try:
            sched.submit([1, 2], SamplingParams(max_tokens=2))
        finally:
            sched.max_queue = old


def test_client_disconnect_mid_stream_frees_slot_and_pages(served):
    n_before = len(served.finished)
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", served.url + "/v1/completions",
                      json={"prompt": [3] * 20, "max_tokens": 200, "temperature": 0, "stream": True,
                            "ignore_eos": True}) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]          # a few chunks, then hang up
            assert any(x.startswith("data: {") for x in got)
    m = wait_idle(served.url)
    assert m["k3jax_slots_in_use"] == 0 and m["k3jax_free_pages"] == PAGES
    new = served.finished[n_before:]
    assert new and new[-1][1] == "abort" and new[-1][2] < 200


def test_python_api_submit_stream_cancel_and_a_failing_consumer(served):
    sched = served.srv.scheduler
    with pytest.raises(RequestError, match="prompt: empty"):
        sched.submit([], SamplingParams(max_tokens=2))
    good = sched.submit([11, 12, 13], SamplingParams(max_tokens=6))

    def explode(ev):
        raise ValueError("consumer broke")

    bad = sched.submit([11, 12, 13, 14], SamplingParams(max_tokens=6), callback=explode)
    long = sched.submit([4] * 10, SamplingParams(max_tokens=200, ignore_eos=True))
    events = []
    for ev in long.stream(timeout=60):
        events.append(ev)
        if len(events) == 3:
            sched.cancel(long)
    assert events[-1].finished and events[-1].finish_reason == "abort" and len(long.tokens) < 200
    assert good.result(timeout=60) == offline(served, [11, 12, 13], 6)
    deadline = time.monotonic() + 30
    while not bad.finished and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bad.finish_reason == "error" and "consumer broke" in bad.error


def test_cli_serve_starts_answers_and_exits_cleanly_on_sigterm():
    """``k3jax serve`` in its own process (with ``--speculative ngram:2``): prints URL, slots, cache memory and
    compiled shapes, answers a streamed request, and on SIGTERM in the middle of a stream drains it and exits 0."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "k3jax.cli", "serve", "--model", "test", "--port", str(port),
                          "--max-slots", "2", "--max-model-len", "128", "--chunk", "16", "--page-size", "16",
                          "--speculative", "ngram:2"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    out = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            out.append(line)
            if "ready" in line:
                break
        log = "".join(out)
        assert f"http://127.0.0.1:{port}" in log, log
        assert "2 slots" in log and "bytes per slot" in log and "pages of 16 tokens" in log, log
        assert "prefill [[1, 16]]" in log and "decode [[2, 1]]" in log, log
        assert "speculative decoding: n-gram prompt lookup, k=2" in log and "speculative [[2, 3]]" in log, log
        with httpx.Client(timeout=60) as h:
            assert h.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
            with h.stream("POST", f"http://127.0.0.1:{port}/v1/completions",
                          json={"prompt": "hello", "max_tokens": 60, "stream": True, "ignore_eos": True}) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                p.send_signal(signal.SIGTERM)
                rest = list(lines)
            assert rest[-1] == "data: [DONE]" or rest[-2:] == ["data: [DONE]", ""], rest[-3:]
        rc = p.wait(timeout=60)
        tail = p.stdout.read()
        assert rc == 0, tail
        assert "shutting down" in tail and "POST /v1/completions 200" in log + tail
    finally:
        if p.poll() is None:
            p.kill()


def test_incremental_detokenizer_and_stop_strings_equal_whole_text(tmp_path):
    """Streamed text deltas (a short window per push, unfinished UTF-8 held back) add up to the whole decode; stop
    strings cut at their first occurrence even when split across deltas."""
    import random

    from k3jax.text.stream import IncrementalDecoder, StopStrings

    write_release_tokenizer(tmp_path, extra_merges=["中".encode(), "文".encode()[:2]])
    tok = TiktokenTokenizer(tmp_path)
    rnd = random.Random(0)
    for _ in range(200):
        ids = tok.encode_ordinary("héllo 中文 ✓ wörld " * rnd.randint(1, 3)) + \
            [rnd.randrange(0, 258) for _ in range(rnd.randint(0, 5))]
        dec, out, i = IncrementalDecoder(tok), "", 0
        while i < len(ids):
            k = rnd.randint(1, 3)
            out += dec.push(ids[i:i + k])
            i += k
        assert out + dec.flush() == tok.decode(ids)
    st, sent = StopStrings(["wör", "zz"]), ""
    for piece in ["héllo ", "中文 ✓ w", "ö", "rld"]:
        sent += st.push(piece)
        if st.hit:
            break
    assert st.hit and sent == "héllo 中文 ✓ "


# ------------------------------------------------------------------------------------------------------ images
@pytest.fixture(scope="module")
def seeing(served, tmp_path_factory):
    """A third app over the same scheduler that takes images (the engine's random tiny vision tower encodes them)."""
    from k3jax.serve.images import ImagePolicy, VisionService
    from k3jax.vision import MediaConfig

    d = tmp_path_factory.mktemp("images")
    service = VisionService(MediaConfig(), CHAT_IDS["<|media_pad|>"], ImagePolicy(image_dir=d))
    app = create_app(served.srv.scheduler, served.tok, ServeConfig(model_name="k3-test", max_model_len=MAX_LEN,
                                                                    own_scheduler=False), vision=service)
    srv = Server(served.srv.scheduler, None, app, "127.0.0.1", free_port(), "k3-test").start_background()
    yield types.SimpleNamespace(url=srv.url, service=service, dir=d, encoder=served.encoder,
                                client=openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                                                     timeout=60))
    srv.stop()


def _png(w, h, seed) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def _data_url(raw: bytes, mime="image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def test_chat_with_a_data_url_image_matches_offline(served, seeing):
    from k3jax.vision import process_image, splice_prompt

    raw = _png(70, 56, 1)
    (seeing.dir / "cat.png").write_bytes(raw)
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(raw)}},
                                             {"type": "text", "text": "What is this?"}]}]
    r = seeing.client.chat.completions.create(model="k3-test", messages=messages, max_tokens=6, temperature=0,
                                              reasoning_effort="none", extra_body={"return_token_ids": True})
    img = process_image(raw)
    ids = encode_chat(served.tok, [{"role": "user", "content": [{"type": "image"}, "What is this?"]}],
                      thinking=False, image_prompts=[img.prompt()])
    assert img.prompt() == "<|media_begin|>image 70x56<|media_content|><|media_pad|><|media_end|>"
    mp = splice_prompt(ids, seeing.encoder.encode([img]), CHAT_IDS["<|media_pad|>"], [img.digest])
    from k3jax.infer.engine import _engine_for                # the engine offline() uses: its decode is compiled

    want = _engine_for(served.model, 256).generate([mp.ids], 6, embeds=[mp], stop_tokens=[EOM]).tokens[0]
    ch = r.choices[0]
    assert ch.prompt_token_ids == mp.ids and ch.token_ids == want and r.usage.prompt_tokens == len(mp.ids)
    # a local file under the server's --image-dir is the same image
    local = dict(messages[0], content=[{"type": "image_url", "image_url": {"url": "cat.png"}}, "What is this?"])
    r2 = seeing.client.chat.completions.create(model="k3-test", messages=[local], max_tokens=6, temperature=0,
                                               reasoning_effort="none", extra_body={"return_token_ids": True})
    assert r2.choices[0].token_ids == want
    assert seeing.encoder.compiles == {64: 1}            # the one patch bucket, compiled at warm-up and not again


@pytest.mark.parametrize("url,fragment", [
    ("data:image/png;base64,!!!", "invalid base64"),
    (_data_url(b"GIF89a nonsense"), "not a decodable image"),
    ("data:image/png;base64,", "empty image"),
    ("https://example.com/cat.png", "remote image URLs are not fetched"),
    ("/etc/passwd", "outside the server's image directory"),
    ("missing.png", "no such image file"),
])
def test_bad_images_are_400_naming_the_content_part(seeing, url, fragment):
    body = {"model": "k3-test", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": url}}]}]}
    r = httpx.post(seeing.url + "/v1/chat/completions", json=body, timeout=30)
    err = r.json()["error"]
    assert r.status_code == 400 and fragment in err["message"], err
    assert err["message"].startswith("messages[0].content[1]") and err["param"].startswith("messages[0].content[1]")


def test_images_on_a_server_without_a_vision_tower_are_400(served):
    body = {"model": "k3-test", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(_png(28, 28, 0))}}]}]}
    r = httpx.post(served.url + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
