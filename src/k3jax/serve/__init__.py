"""``k3jax serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching
:class:`~k3jax.infer.scheduler.Scheduler`: :mod:`~k3jax.serve.protocol` (bodies), :mod:`~k3jax.serve.openai`
(handlers), :mod:`~k3jax.serve.app` (routes), :mod:`~k3jax.serve.server` (build and run)."""

from k3jax.serve.app import ServeConfig, create_app
from k3jax.serve.protocol import APIError
from k3jax.serve.server import Server, ServerOptions, build_server

__all__ = ["APIError", "ServeConfig", "create_app", "Server", "ServerOptions", "build_server"]
