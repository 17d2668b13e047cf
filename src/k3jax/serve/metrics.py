"""The server's Prometheus metrics (one registry per app): request, token and latency series kept by the app, and
the scheduler's slot, page, queue, compile, prefix-cache and speculative-decoding figures read from the snapshot the
scheduler publishes after each step (:meth:`Scheduler.snapshot`: immutable, read at scrape time without touching
engine state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from k3jax.infer.scheduler import Scheduler

class ServerMetrics:
    """Prometheus metrics of one app (own registry): request counters by endpoint and status, token counters,
    TTFT/TPOT histograms; slot, page, queue and preemption figures read from the scheduler at scrape time."""

    def __init__(self, sched: Scheduler):
        self.registry = CollectorRegistry()
        self.requests = Counter("k3jax_requests", "HTTP requests by endpoint and status", ["endpoint", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("k3jax_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("k3jax_generation_tokens", "generated tokens of finished requests",
                                         registry=self.registry)
        buckets = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
        self.ttft = Histogram("k3jax_time_to_first_token_seconds", "arrival → first generated token",
                              buckets=buckets, registry=self.registry)
        self.tpot = Histogram("k3jax_time_per_output_token_seconds", "mean gap between generated tokens",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
                              registry=self.registry)
        self.registry.register(_SchedulerCollector(sched))

    def observe(self, req) -> None:
        self.prompt_tokens.inc(req.prompt_tokens)
        self.generation_tokens.inc(len(req.tokens))
        if req.first_token_time is not None:
            self.ttft.observe(req.first_token_time - req.arrival)
            if len(req.tokens) > 1 and req.finish_time is not None:
                self.tpot.observe((req.finish_time - req.first_token_time) / (len(req.tokens) - 1))



# (snapshot key, metric kind, help); the scheduler's own figures, then the prefix cache's (``snapshot()["prefix"]``)
_SCHEDULER = [("slots_in_use", "gauge", "decode slots holding a sequence"), ("max_slots", "gauge", "decode slots"),
              ("free_pages", "gauge", "free MLA cache pages"), ("num_pages", "gauge", "MLA cache pages"),
              ("queue_length", "gauge", "requests waiting for a slot or pages"),
              ("preemptions", "counter", "sequences preempted for lack of pages (re-queued and recomputed)"),
              ("steps", "counter", "scheduler steps"), ("decode_steps", "counter", "decode steps"),
              ("decode_rows", "counter", "sequences advanced by decode steps (÷ decode_steps: mean batch)"),
              ("prefill_chunks", "counter", "prefill chunks run"),
              ("mixed_steps", "counter", "steps that carried decoding rows and a prefill chunk (one forward with mixed steps on, else two)")]
_PREFIX = [("lookups", "counter", "prefix-cache lookups (admissions with the cache on)"),
           ("hits", "counter", "lookups that resumed from a cached prefix"),
           ("queried_tokens", "counter", "tokens of the sequences looked up"),
           ("hit_tokens", "counter", "tokens served from the prefix cache instead of prefilled"),
           ("evictions", "counter", "prefix-cache nodes evicted (LRU, or dropped by verification)"),
           ("checkpoints_saved", "counter", "KDA checkpoints saved"),
           ("verified", "counter", "hits recomputed and compared (--prefix-cache-verify)"),
           ("verify_failures", "counter", "hits whose recomputation disagreed (dropped and recomputed)"),
           ("hit_rate", "gauge", "hit tokens / looked-up tokens since start"),
           ("checkpoints", "gauge", "KDA checkpoints held"),
           ("checkpoint_bytes", "gauge", "bytes of KDA checkpoints held"),
           ("cached_pages", "gauge", "MLA pages referenced by cached prefixes"),
           ("held_bytes", "gauge", "checkpoint bytes + bytes of cached pages"),
           ("budget_bytes", "gauge", "the prefix cache's memory budget (--prefix-cache-memory)")]
_SPEC = [("steps", "counter", "decode steps that ran a speculative round"),
         ("rounds", "counter", "slot rounds that verified drafts (a step holds one per drafting slot)"),
         ("draft_tokens", "counter", "tokens drafted"),
         ("accepted_tokens", "counter", "drafted tokens the target accepted"),
         ("acceptance_rate", "gauge", "accepted / drafted tokens since start"),
         ("mean_accepted_length", "gauge", "accepted drafts per round since start (tokens per round − 1)"),
         ("fallback_steps", "counter", "steps with drafts that decoded plainly (a round would not have paid)"),
         ("retime_rounds", "counter", "rounds run only to measure their step time again after many refusals"),
         ("draft_prefill_chunks", "counter", "chunks the draft model prefilled to catch up with the target")]


def _families(prefix: str, table, values: dict):
    for key, kind, doc in table:
        family = (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(f"{prefix}{key}", doc)
        family.add_metric([], values[key])
        yield family


class _SchedulerCollector:
    def __init__(self, sched: Scheduler):
        self.sched = sched

    def collect(self):
        s = self.sched.snapshot()
        yield from _families("k3jax_", _SCHEDULER, s)
        g = GaugeMetricFamily("k3jax_compiles", "jit compilations of the step functions", labels=["step"])
        for k, v in s["compiles"].items():
            g.add_metric([k], v)
        yield g
        if s.get("prefix") is not None:
            yield from _families("k3jax_prefix_cache_", _PREFIX, s["prefix"])
        if s.get("spec") is not None:
            yield from _families("k3jax_spec_", _SPEC, s["spec"])


__all__ = ["ServerMetrics"]
