"""Build and run the server: load a model, size the slot pool and page pool, compile, then serve with uvicorn.

``build_server(...)`` returns a :class:`Server` (scheduler warmed up and started, app built) that
``Server.run()`` serves in the foreground (Ctrl-C / SIGTERM: drain, then exit) or ``Server.start_background()``
serves from a thread (tests, benchmarks, notebooks); ``Server.url`` is where it listens.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import uvicorn

from k3jax.infer.load import load_model
from k3jax.infer.scheduler import Scheduler
from k3jax.infer.speculative import SpecConfig
from k3jax.serve.app import ServeConfig, create_app

log = logging.getLogger("k3jax.serve")


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


def build_server(model: str | object, *, host: str = "127.0.0.1", port: int = 8000, max_slots: int = 8,
                 max_model_len: int | None = None, kv_cache_memory: int | None = None, chunk: int = 256,
                 page_size: int = 64, max_queue: int = 256, max_step_tokens: int | None = None,
                 served_model_name: str | None = None, tokenizer=None, dtype: str | None = None,
                 default_max_tokens: int = 256, drain_timeout: float = 10.0, prefix_cache: bool = True,
                 prefix_cache_memory: int | None = None, prefix_cache_stride: int = 4,
                 prefix_cache_verify: bool = False, speculative: str | SpecConfig | None = None,
                 speculative_adaptive: bool = True, draft_model=None, vision: bool | None = None,
                 image_dir: str | Path | None = None, allow_remote_images: bool = False,
                 say: Callable[[str], None] | None = None) -> Server:
    """Load ``model`` (a path or preset, as ``k3jax generate --model``; or a loaded :class:`K3ForCausalLM` with
    ``tokenizer``), build the scheduler, compile its steps (``say`` reports progress), start it and build the
    app. ``port`` 0 picks a free port. ``speculative``: ``ngram:K`` or ``draft:PATH:K`` (or a
    :class:`~k3jax.infer.speculative.SpecConfig`); ``speculative_adaptive=False`` speculates whenever there are
    drafts (no fallback); ``draft_model`` a loaded draft instead of PATH. ``vision``: load the checkpoint's vision
    tower so chat requests may carry images (default: when its config.json has a ``vision_config``; a loaded
    :class:`~k3jax.vision.model.K3ForConditionalGeneration` always); ``image_dir``: local image paths allowed under
    it; ``allow_remote_images``: fetch http(s) image URLs."""
    say = say or (lambda s: log.info(s))
    t0 = time.perf_counter()
    media = None
    if isinstance(model, (str, Path)):
        path = Path(str(model))
        name = served_model_name or path.name
        if vision is None:
            vision = _has_vision_config(path)
        say(f"loading {model}{' with its vision tower' if vision else ''}")
        model, tok, what = load_model(str(model), dtype=dtype, vision=bool(vision))
        tokenizer = tokenizer or tok
        if vision:
            from k3jax.vision.config import MediaConfig

            media = MediaConfig.from_dir(path)
    else:
        name = served_model_name or "k3jax"
        what = "model object"
        if tokenizer is None:
            raise ValueError("tokenizer: required when a model object is passed")
    service = None
    from k3jax.vision.model import K3ForConditionalGeneration

    if isinstance(model, K3ForConditionalGeneration):
        from k3jax.infer.multimodal import check_pad_token
        from k3jax.serve.images import ImagePolicy, VisionService
        from k3jax.vision.config import MediaConfig

        check_pad_token(model, tokenizer)
        policy = ImagePolicy(image_dir=Path(image_dir) if image_dir is not None else None,
                             allow_remote=allow_remote_images)
        service = VisionService(model.encoder(), media or MediaConfig(), model.pad_id, policy)
        model = model.language_model
        say(f"vision: {model_vision_summary(service)}")
    spec = SpecConfig.parse(speculative) if isinstance(speculative, str) else speculative
    if spec is not None and not speculative_adaptive:
        spec = dataclasses.replace(spec, adaptive=False)
    if spec is not None and spec.method == "draft" and draft_model is None:
        say(f"loading the draft model {spec.draft}")
        draft_model, _, dwhat = load_model(spec.draft)
        say(f"draft: {dwhat}")
    sched = Scheduler(model, max_slots=max_slots, max_model_len=max_model_len, kv_cache_memory=kv_cache_memory,
                      chunk=chunk, page_size=page_size, max_queue=max_queue, max_step_tokens=max_step_tokens,
                      prefix_cache=prefix_cache, prefix_cache_memory=prefix_cache_memory,
                      prefix_stride=prefix_cache_stride, prefix_verify=prefix_cache_verify, speculative=spec,
                      draft_model=draft_model)
    mem = sched.memory()
    say(f"{what}: {max_slots} slots × max_model_len {sched.max_model_len}; cache: KDA state "
        f"{mem['kda_state_bytes_per_slot']:,} bytes per slot, MLA latent {mem['mla_bytes_per_token']:,} bytes per "
        f"token in {sched.num_pages} pages of {sched.page_size} tokens ({mem['mla_pool_bytes']:,} bytes); "
        f"total {mem['total_bytes']:,} bytes")
    if sched.prefix is not None:
        say(f"prefix cache: {sched.prefix.block}-token blocks, a KDA checkpoint every {sched.prefix.stride} blocks "
            f"and at each prompt's last boundary ({mem['prefix_checkpoint_bytes']:,} bytes each); budget "
            f"{mem['prefix_budget_bytes']:,} bytes{'; verifying every hit' if sched.prefix_verify else ''}")
    else:
        say("prefix cache: off")
    if spec is not None:
        say(f"speculative decoding: {spec.describe()}; "
            f"{'falls back to plain decode when drafts do not pay' if spec.adaptive else 'no fallback'}; "
            f"verify records {mem['spec_record_bytes_per_slot']:,} bytes per slot (vs "
            f"{mem['spec_state_snapshots_bytes_per_slot']:,} for a KDA state per draft position)")
    say(f"compiling: prefill chunks {list(sched.buckets)} (batch 1) and decode batches {list(sched.decode_sizes)} …")
    t1 = time.perf_counter()
    shapes = sched.warmup()
    say(f"compiled in {time.perf_counter() - t1:.1f} s: prefill {shapes['prefill']}, decode {shapes['decode']}"
        + (f", speculative {shapes['speculative']}" if "speculative" in shapes else ""))
    sched.start()
    app = create_app(sched, tokenizer, ServeConfig(model_name=name, max_model_len=sched.max_model_len,
                                                   default_max_tokens=default_max_tokens,
                                                   drain_timeout=drain_timeout), vision=service)
    if port == 0:
        port = free_port(host)
    return Server(sched, tokenizer, app, host, port, name, shapes, time.perf_counter() - t0)


def _has_vision_config(path: Path) -> bool:
    import json

    f = path / "config.json"
    if not (path.is_dir() and f.exists() and any(path.glob("*.safetensors"))):
        return False
    try:
        return bool(json.loads(f.read_text()).get("vision_config"))
    except (json.JSONDecodeError, AttributeError):
        return False


def model_vision_summary(service) -> str:
    c = service.encoder.cfg
    p = service.policy
    return (f"MoonViT {c.vt_num_hidden_layers} blocks × {c.vt_hidden_size}, patch buckets "
            f"{list(service.encoder.buckets)} (compiled on first use); images from data: URLs"
            f"{f', files under {p.image_dir}' if p.image_dir else ''}{', remote URLs' if p.allow_remote else ''}")


__all__ = ["Server", "build_server", "free_port"]
