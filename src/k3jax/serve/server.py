"""Build and run the server: load a model, build the engine from an :class:`~k3jax.infer.config.EngineConfig`,
compile, then serve with uvicorn.

``build_server(model, EngineConfig(...), ServerOptions(...))`` returns a :class:`Server` (scheduler warmed up and
started, app built) that ``Server.run()`` serves in the foreground (Ctrl-C / SIGTERM: drain, then exit) or
``Server.start_background()`` serves from a thread (tests, benchmarks, notebooks); ``Server.url`` is where it
listens. :class:`ServerOptions` holds the options that are not the engine's (address, names, images);
``k3jax serve`` makes its flags from both dataclasses.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import uvicorn

from k3jax.infer.config import EngineConfig, option
from k3jax.infer.load import load_model
from k3jax.infer.scheduler import Scheduler
from k3jax.serve.app import ServeConfig, create_app

log = logging.getLogger("k3jax.serve")


@dataclass(frozen=True)
class ServerOptions:
    """What ``k3jax serve`` takes besides the engine's options (each with its one default)."""

    host: str = option("127.0.0.1", "bind address (default loopback only)")
    port: int = option(8000, "port (0: a free one)")
    served_model_name: str | None = option(None, "the model id clients send (default: the path's name)")
    default_max_tokens: int = option(256, "max_tokens when a request gives none")
    drain_timeout: float = option(10.0, "seconds running requests may finish in after Ctrl-C / SIGTERM",
                                  parse=float)
    dtype: str | None = option(None, "compute dtype override (float32, bfloat16)")
    vision: bool = option(True, "load a checkpoint's vision tower when its config has one")
    image_dir: str | None = option(None, "allow chat image_url parts naming local files under DIR (default: "
                                         "data: URLs only)", metavar="DIR")
    allow_remote_images: bool = option(False, "fetch http(s) image URLs (10 s timeout, 20 MiB limit); refused "
                                              "with a 400 otherwise")

    def __post_init__(self):
        if not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port: expected an integer in [0, 65536), got {self.port!r}")
        if not isinstance(self.default_max_tokens, int) or self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens: expected an integer ≥ 1, got {self.default_max_tokens!r}")
        if not self.drain_timeout >= 0:
            raise ValueError(f"drain_timeout: expected seconds ≥ 0, got {self.drain_timeout!r}")


@dataclass
class Server:
    scheduler: Scheduler
    tokenizer: object
    app: object
    host: str
    port: int
    model_name: str
    compiled: dict = field(default_factory=dict)
    startup_s: float = 0.0
    _uvicorn: uvicorn.Server | None = None
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _config(self, log_level: str) -> uvicorn.Config:
        return uvicorn.Config(self.app, host=self.host, port=self.port, log_level=log_level, access_log=False,
                              timeout_graceful_shutdown=5, lifespan="on")

    def run(self, log_level: str = "info", on_ready: Callable[[], None] | None = None) -> None:
        """Serve in the foreground until Ctrl-C / SIGTERM (uvicorn's handlers), then drain and stop;
        ``on_ready()`` runs once the socket accepts connections."""
        self._uvicorn = uvicorn.Server(self._config(log_level))
        if on_ready is not None:
            def watch():
                while not self._uvicorn.started and not self._uvicorn.should_exit:
                    time.sleep(0.02)
                if self._uvicorn.started:
                    on_ready()
            threading.Thread(target=watch, daemon=True).start()
        self._uvicorn.run()

    def start_background(self, log_level: str = "warning", timeout: float = 30.0) -> "Server":
        """Serve from a daemon thread; returns once the socket accepts connections."""
        self._uvicorn = uvicorn.Server(self._config(log_level))
        self._thread = threading.Thread(target=self._uvicorn.run, name="k3jax-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._uvicorn.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop a background server (drains like SIGTERM does)."""
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def build_server(model, engine: EngineConfig | None = None, options: ServerOptions | None = None, *,
                 tokenizer=None, draft_model=None, encoder=None, pad_id: int | None = None,
                 say: Callable[[str], None] | None = None) -> Server:
    """Load ``model`` (a path or preset, as ``k3jax generate --model``; or a loaded :class:`K3ForCausalLM` /
    :class:`~k3jax.vision.model.K3ForConditionalGeneration` with ``tokenizer``), build the scheduler from
    ``engine``, compile its steps (``say`` reports progress), start it and build the app. ``draft_model``: a
    loaded draft for ``engine.speculative`` = ``draft:PATH:K`` instead of PATH; ``encoder`` / ``pad_id``: a vision
    encoder for a text model object (images then reach the engine through an app made with a
    :class:`~k3jax.serve.images.VisionService`)."""
    engine, options = engine or EngineConfig(), options or ServerOptions()
    say = say or (lambda s: log.info(s))
    t0 = time.perf_counter()
    model, tokenizer, name, what, media = _load(model, tokenizer, options, say)
    service = None
    from k3jax.vision.model import K3ForConditionalGeneration

    if isinstance(model, K3ForConditionalGeneration):
        service, encoder, pad_id, model = _vision(model, tokenizer, media, options, say)
    spec = engine.speculative
    if spec is not None and spec.method == "draft" and draft_model is None:
        say(f"loading the draft model {spec.draft}")
        draft_model, _, dwhat = load_model(spec.draft)
        say(f"draft: {dwhat}")
    sched = Scheduler(model, engine, draft_model=draft_model, encoder=encoder, pad_id=pad_id)
    _describe(sched, what, say)
    sz = sched.sizes
    say(f"compiling: prefill chunks {list(sz.prefill)} (batch 1), decode batches {list(sz.decode)}"
        + (f", mixed with chunks {list(sz.mixed_chunks())}" if engine.mixed_steps else "") + " …")
    t1 = time.perf_counter()
    shapes = sched.warmup()
    say(f"compiled in {time.perf_counter() - t1:.1f} s: prefill {shapes['prefill']}, decode {shapes['decode']}"
        + (f", mixed {shapes['mixed']}" if shapes["mixed"] else "")
        + (f", speculative {shapes['speculative']}" if "speculative" in shapes else ""))
    sched.start()
    app = create_app(sched, tokenizer, ServeConfig(model_name=name, max_model_len=sz.max_model_len,
                                                   default_max_tokens=options.default_max_tokens,
                                                   drain_timeout=options.drain_timeout), vision=service)
    port = options.port or free_port(options.host)
    return Server(sched, tokenizer, app, options.host, port, name, shapes, time.perf_counter() - t0)


def _load(model, tokenizer, options: ServerOptions, say):
    """``(model, tokenizer, served name, description, media config or None)``."""
    if not isinstance(model, (str, Path)):
        if tokenizer is None:
            raise ValueError("tokenizer: required when a model object is passed")
        return model, tokenizer, options.served_model_name or "k3jax", "model object", None
    path = Path(str(model))
    vision = options.vision and _has_vision_config(path)
    say(f"loading {model}{' with its vision tower' if vision else ''}")
    loaded, tok, what = load_model(str(model), dtype=options.dtype, vision=vision)
    media = None
    if vision:
        from k3jax.vision.config import MediaConfig

        media = MediaConfig.from_dir(path)
    return loaded, tokenizer or tok, options.served_model_name or path.name, what, media


def _vision(model, tokenizer, media, options: ServerOptions, say):
    """The multimodal model's parts: ``(VisionService, encoder, pad id, text model)``."""
    from k3jax.infer.multimodal import check_pad_token
    from k3jax.serve.images import ImagePolicy, VisionService
    from k3jax.vision.config import MediaConfig

    check_pad_token(model, tokenizer)
    policy = ImagePolicy(image_dir=Path(options.image_dir) if options.image_dir is not None else None,
                         allow_remote=options.allow_remote_images)
    service = VisionService(media or MediaConfig(), model.pad_id, policy)
    encoder = model.encoder()
    c = encoder.cfg
    say(f"vision: MoonViT {c.vt_num_hidden_layers} blocks × {c.vt_hidden_size}, patch buckets "
        f"{list(encoder.buckets)}; images from data: URLs{f', files under {policy.image_dir}' if policy.image_dir else ''}"
        f"{', remote URLs' if policy.allow_remote else ''}")
    return service, encoder, model.pad_id, model.language_model


def _describe(sched: Scheduler, what: str, say) -> None:
    mem, sz = sched.memory(), sched.sizes
    say(f"{what}: {sz.max_slots} slots × max_model_len {sz.max_model_len}; cache: KDA state "
        f"{mem['kda_state_bytes_per_slot']:,} bytes per slot, MLA latent {mem['mla_bytes_per_token']:,} bytes per "
        f"token in {sz.num_pages} pages of {sz.page_size} tokens ({mem['mla_pool_bytes']:,} bytes); "
        f"total {mem['total_bytes']:,} bytes")
    if sched.prefix is not None:
        idx = sched.prefix.index
        say(f"prefix cache: {idx.block}-token blocks, a KDA checkpoint every {idx.stride} blocks and at each "
            f"prompt's last boundary ({mem['prefix_checkpoint_bytes']:,} bytes each); budget "
            f"{mem['prefix_budget_bytes']:,} bytes{'; verifying every hit' if sched.prefix.verify else ''}")
    else:
        say("prefix cache: off")
    spec = sched.config.speculative
    if spec is not None:
        say(f"speculative decoding: {spec.describe()}; "
            f"{'falls back to plain decode when drafts do not pay' if spec.adaptive else 'no fallback'}; "
            f"verify records {mem['spec_record_bytes_per_slot']:,} bytes per slot (vs "
            f"{mem['spec_state_snapshots_bytes_per_slot']:,} for a KDA state per draft position)")


def _has_vision_config(path: Path) -> bool:
    f = path / "config.json"
    if not (path.is_dir() and f.exists() and any(path.glob("*.safetensors"))):
        return False
    try:
        return bool(json.loads(f.read_text()).get("vision_config"))
    except (json.JSONDecodeError, AttributeError):
        return False


__all__ = ["Server", "ServerOptions", "build_server", "free_port"]
