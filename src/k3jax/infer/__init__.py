"""Inference: the engine behind ``k3jax serve`` and ``k3jax generate``.

:class:`EngineConfig` (every option), :class:`Scheduler` (policy: admission, budget, preemption, prefix cache,
speculation; :mod:`k3jax.infer.scheduler`), :class:`~k3jax.infer.runner.ModelRunner` (the device side: parameters,
slot caches, jitted steps), :class:`~k3jax.infer.slots.SlotPool` (slots and pages, host only), :class:`Engine`
(offline generation driving the same scheduler synchronously), sampling, loading a model (``infer.load``) and text
sampling (``infer.sample_text``). Tokenizers are :mod:`k3jax.text.tokenizer`, shared with training."""

from k3jax.infer.config import EngineConfig, EngineConfigError
from k3jax.infer.engine import Engine, GenerateResult, GenerationError, generate
from k3jax.infer.requests import QueueFull, Request, RequestError, SamplingParams, TokenEvent
from k3jax.infer.scheduler import Scheduler

__all__ = ["Engine", "EngineConfig", "EngineConfigError", "GenerateResult", "GenerationError", "generate",
           "Scheduler", "SamplingParams", "Request", "TokenEvent", "RequestError", "QueueFull"]
