"""``k3jax serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous-batching
:class:`~k3jax.infer.scheduler.Scheduler`."""

from k3jax.serve.app import APIError, ServeConfig, create_app
from k3jax.serve.server import Server, build_server

__all__ = ["APIError", "ServeConfig", "create_app", "Server", "build_server"]
