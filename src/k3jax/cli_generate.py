"""``k3jax generate``: text prompts through the engine, images through the multimodal model (``--image``), and
speculative decoding through the serving scheduler (``--speculative``)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from k3jax.cli import console


class _TextStream:
    """Print a growing token list as text: only the new characters, holding back an unfinished UTF-8 sequence."""

    def __init__(self, tokenizer, out):
        self.tok, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def __call__(self, row: int, token: int) -> None:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)


def cmd_generate(args: argparse.Namespace) -> int:
    import logging
    import sys

    from k3jax.infer.engine import Engine
    from k3jax.infer.load import load_model

    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.image:
        return _generate_with_images(args)
    model, tok, what = load_model(args.model, dtype=args.dtype)
    cfg = model.config
    if cfg.vocab_size < tok.vocab_size:
        console.print(f"[yellow]warning: tokenizer {tok.name} has {tok.vocab_size} ids, the model {cfg.vocab_size}")
    prompts = args.prompt or [""]
    ids = [([tok.bos_id] if (tok.bos_id is not None and not args.no_bos) else []) + tok.encode(p) for p in prompts]
    # the config's eos_token_id ends a sequence (<|end_of_msg|> in the release, not the tokenizer's [EOS]);
    # the tokenizer's eos only when the config names none
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    stops = list(eos) if not args.ignore_eos else []
    stops += [int(s) for s in (args.stop or [])]
    if args.speculative:
        if args.no_repeat_ngram:
            console.print("[red]error:[/red] --no-repeat-ngram: not supported with --speculative (the guard would "
                          "change the target's distribution that verification keeps)")
            return 2
        return _generate_speculative(args, model, tok, what, prompts, ids, stops)
    engine = Engine(model, chunk=args.chunk, max_len=args.max_len)
    console.print(f"[bold]k3jax generate[/bold] {what}; tokenizer {tok.name}; "
                  f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}"
                  f"{f', top-k {args.top_k}' if args.top_k else ''}{f', top-p {args.top_p}' if args.top_p else ''}"
                  f", seed {args.seed}", highlight=False)
    stream = _TextStream(tok, sys.stdout) if (len(ids) == 1 and not args.no_stream) else None
    if stream is not None:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    res = engine.generate(ids, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                          top_p=args.top_p, seed=args.seed, stop_tokens=stops, on_token=stream,
                          no_repeat_ngram=args.no_repeat_ngram)
    if stream is not None:
        sys.stdout.write("\n")
    else:
        for p, out in zip(prompts, res.tokens):
            console.rule()
            console.print(p + tok.decode(out), markup=False, highlight=False)
    st = res.stats
    used = st["cache_bytes_in_use_per_sequence"]
    console.print(f"prefill {st['prefill_tokens']} tokens in {st['prefill_s']:.2f} s (incl. compile); decode "
                  f"{st['generated_tokens']} tokens, {st['decode_tokens_per_s']:.1f} tokens/s "
                  f"({st['decode_steady_tokens_per_s']:.1f} tokens/s after the first, compiling, step)",
                  highlight=False)
    console.print(f"cache per sequence: {used['total']:,} bytes in use (KDA state {used['kda_recurrent_state']:,} + "
                  f"conv {used['kda_conv_state']:,} + MLA latent {used['mla_latent_cache']:,}); "
                  f"{st['cache_bytes_per_sequence']['total'] * len(ids):,} bytes allocated "
                  f"(bucket {st['cache_bucket']} tokens × {len(ids)} sequences)", highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": prompts, "tokens": res.tokens,
                                               "text": [tok.decode(t) for t in res.tokens], "stats": st}, indent=2))
    return 0


def _generate_with_images(args: argparse.Namespace) -> int:
    """``k3jax generate --image``: one chat turn (the images, then the prompt) through the multimodal model."""
    import sys

    from k3jax.infer.load import load_model
    from k3jax.infer.multimodal import MultimodalGenerator
    from k3jax.text.chat import parse_assistant
    from k3jax.vision.config import MediaConfig

    if args.prompt and len(args.prompt) > 1:
        console.print("[red]error:[/red] --image: one --prompt (the images belong to it)")
        return 2
    if args.speculative:
        console.print("[red]error:[/red] --image: not supported with --speculative")
        return 2
    model, tok, what = load_model(args.model, dtype=args.dtype, vision=True)
    gen = MultimodalGenerator(model, tok, media=MediaConfig.from_dir(args.model), chunk=args.chunk,
                              max_len=args.max_len)
    text = (args.prompt or [""])[0]
    stops = [] if args.ignore_eos else None
    console.print(f"[bold]k3jax generate[/bold] {what} with {len(args.image)} image(s); tokenizer {tok.name}; "
                  f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}, seed {args.seed}",
                  highlight=False)
    stream = _TextStream(tok, sys.stdout) if not args.no_stream else None
    kw = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
              on_token=stream, no_repeat_ngram=args.no_repeat_ngram)
    if stops is not None:
        kw["stop_tokens"] = stops + [int(s) for s in (args.stop or [])]
    elif args.stop:
        eos = model.config.eos_token_id
        kw["stop_tokens"] = ([eos] if isinstance(eos, int) else list(eos or [])) + [int(s) for s in args.stop]
    res, mp = gen.generate(text, args.image, args.max_new_tokens, thinking=not args.no_thinking, **kw)
    out = res.tokens[0]
    if stream is not None:
        sys.stdout.write("\n")
    else:
        console.print(tok.decode(out), markup=False, highlight=False)
    st = res.stats
    console.print(f"images: {st['image_tokens']} vision tokens in {st['vision_s']:.2f} s (buckets compiled "
                  f"{st['vision_compiles']}, padding {100 * st['vision_padding_waste']:.1f}%); prefill "
                  f"{st['prefill_tokens']} tokens in {st['prefill_s']:.2f} s; decode {st['generated_tokens']} tokens, "
                  f"{st['decode_tokens_per_s']:.1f} tokens/s", highlight=False)
    if args.json:
        msg = parse_assistant(tok.decode(out), thinking=not args.no_thinking) if out else None
        Path(args.json).write_text(json.dumps({"prompt": text, "images": args.image, "prompt_ids": mp.ids,
                                               "tokens": out, "text": tok.decode(out),
                                               "content": getattr(msg, "content", None), "stats": st}, indent=2,
                                              default=str))
    return 0


def _generate_speculative(args, model, tok, what, prompts, ids, stops) -> int:
    """``k3jax generate --speculative``: the prompts through the serving scheduler (one slot each, speculative
    decoding on, no prefix cache), streamed when there is one prompt; then the acceptance figures."""
    import sys

    from k3jax.infer.load import load_model
    from k3jax.infer.scheduler import SamplingParams, Scheduler
    from k3jax.infer.speculative import SpecConfig

    spec = SpecConfig.parse(args.speculative)
    draft = None
    if spec.method == "draft":
        draft, _, dwhat = load_model(spec.draft)
        console.print(f"draft: {dwhat}", highlight=False)
    longest = max(len(x) for x in ids) + args.max_new_tokens
    sched = Scheduler(model, max_slots=len(ids), max_model_len=min(args.max_len or model.config.max_position_embeddings,
                                                                     -(-(longest + 1) // 64) * 64),
                      chunk=args.chunk, prefix_cache=False, speculative=spec, draft_model=draft)
    console.print(f"[bold]k3jax generate[/bold] {what}; tokenizer {tok.name}; speculative: {spec.describe()}; "
                  f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}; compiling …",
                  highlight=False)
    sched.warmup()
    stream = _TextStream(tok, sys.stdout) if (len(ids) == 1 and not args.no_stream) else None
    if stream is not None:
        sys.stdout.write(prompts[0])
        sys.stdout.flush()
    params = SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, stop_token_ids=tuple(stops), ignore_eos=True)
    import threading

    streamed = threading.Event()

    def cb(ev):
        for t in ev.tokens:
            stream(0, t)
        if ev.finished:
            streamed.set()

    t0 = time.perf_counter()
    sched.start()
    try:
        reqs = [sched.submit(x, params, callback=cb if (i == 0 and stream is not None) else None)
                for i, x in enumerate(ids)]
        for r in reqs:
            if r.callback is None:
                r.result()
        if stream is not None:
            streamed.wait()
    finally:
        sched.close()
    dt = time.perf_counter() - t0
    if stream is not None:
        sys.stdout.write("\n")
    else:
        for p, r in zip(prompts, reqs):
            console.rule()
            console.print(p + tok.decode(r.tokens), markup=False, highlight=False)
    s = sched.snapshot()["spec"]
    n = sum(len(r.tokens) for r in reqs)
    console.print(f"generated {n} tokens in {dt:.2f} s ({n / dt:.1f} tokens/s, prefill included); drafted "
                  f"{s['draft_tokens']}, accepted {s['accepted_tokens']} (rate {s['acceptance_rate']:.2f}, "
                  f"{s['mean_accepted_length']:.2f} per round over {s['rounds']} rounds; {s['fallback_steps']} steps "
                  f"fell back to plain decode)", highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": prompts, "tokens": [r.tokens for r in reqs],
                                               "text": [tok.decode(r.tokens) for r in reqs], "speculative": s},
                                              indent=2))
    return 0
