"""``k3jax generate``: text prompts through the engine (the serving scheduler and model runner, driven on this
thread; ``--speculative`` drafts there too), images through the multimodal model (``--image``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from k3jax.cli import console


class _TextStream:
    """Print a growing token list as text: only the new characters, holding back an unfinished UTF-8 sequence (the
    server's incremental decoder: O(new tokens) per token)."""

    def __init__(self, tokenizer, out):
        from k3jax.text.stream import IncrementalDecoder

        self.decoder, self.out = IncrementalDecoder(tokenizer), out

    def __call__(self, row: int, token: int) -> None:
        self.out.write(self.decoder.push([token]))
        self.out.flush()

    def close(self) -> None:
        self.out.write(self.decoder.flush() + "\n")


def cmd_generate(args: argparse.Namespace) -> int:
    import logging

    from k3jax.infer.engine import Engine
    from k3jax.infer.load import load_model
    from k3jax.infer.speculative import SpecConfig

    logging.getLogger("absl").setLevel(logging.ERROR)
    if args.image:
        return _generate_with_images(args)
    spec = SpecConfig.parse(args.speculative) if args.speculative else None     # a bad spec fails before loading
    if spec is not None and args.no_repeat_ngram:
        console.print("[red]error:[/red] --no-repeat-ngram: not supported with --speculative (a banned token would "
                      "change the target's distribution that verification keeps)")
        return 2
    model, tok, what = load_model(args.model, dtype=args.dtype)
    cfg = model.config
    if cfg.vocab_size < tok.vocab_size:
        console.print(f"[yellow]warning: tokenizer {tok.name} has {tok.vocab_size} ids, the model {cfg.vocab_size}")
    draft = None
    if spec is not None and spec.method == "draft":
        draft, _, dwhat = load_model(spec.draft)
        console.print(f"draft: {dwhat}", highlight=False)
    prompts = args.prompt or [""]
    ids = [([tok.bos_id] if (tok.bos_id is not None and not args.no_bos) else []) + tok.encode(p) for p in prompts]
    # the config's eos_token_id ends a sequence (<|end_of_msg|> in the release, not the tokenizer's [EOS]);
    # the tokenizer's eos only when the config names none
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tok.eos_id
    eos = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    stops = (list(eos) if not args.ignore_eos else []) + [int(s) for s in (args.stop or [])]
    engine = Engine(model, chunk=args.chunk, max_len=args.max_len, speculative=spec, draft_model=draft)
    console.print(f"[bold]k3jax generate[/bold] {what}; tokenizer {tok.name}; "
                  + (f"speculative: {spec.describe()}; " if spec is not None else "")
                  + f"{'greedy' if args.temperature == 0 else f'temperature {args.temperature}'}"
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
        stream.close()
    else:
        for p, out in zip(prompts, res.tokens):
            console.rule()
            console.print(p + tok.decode(out), markup=False, highlight=False)
    _report(res.stats, len(ids))
    if args.json:
        Path(args.json).write_text(json.dumps({"prompts": prompts, "tokens": res.tokens,
                                               "text": [tok.decode(t) for t in res.tokens], "stats": res.stats},
                                              indent=2, default=str))
    return 0


def _report(st: dict, n: int) -> None:
    used = st["cache_bytes_in_use_per_sequence"]
    console.print(f"prefill {st['prefill_tokens']} tokens in {st['prefill_s']:.2f} s (incl. compile); decode "
                  f"{st['generated_tokens']} tokens, {st['decode_tokens_per_s']:.1f} tokens/s "
                  f"({st['decode_steady_tokens_per_s']:.1f} tokens/s after the first, compiling, step)",
                  highlight=False)
    console.print(f"cache per sequence: {used['total']:,} bytes in use (KDA state {used['kda_recurrent_state']:,} + "
                  f"conv {used['kda_conv_state']:,} + MLA latent {used['mla_latent_cache']:,}); "
                  f"{st['cache_bytes_per_sequence']['total'] * n:,} bytes allocated "
                  f"(bucket {st['cache_bucket']} tokens × {n} sequences)", highlight=False)
    s = st.get("speculative")
    if s is not None:
        console.print(f"speculative: drafted {s['draft_tokens']}, accepted {s['accepted_tokens']} (rate "
                      f"{s['acceptance_rate']:.2f}, {s['mean_accepted_length']:.2f} per round over {s['rounds']} "
                      f"rounds; {s['fallback_steps']} steps fell back to plain decode)", highlight=False)


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
        stream.close()
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
