"""Prometheus metrics of the server, in one registry per app (tests start several in one process).

Request-path figures are recorded as they happen; gauges that describe state (queue depth, running requests,
tokens/s, cache bytes per tier and namespace) are read from the scheduler and the engines at scrape time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

if TYPE_CHECKING:
    from kvboost_core import CacheCounts

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("kvboost_ttft_seconds", "Time to first token (queue wait included)",
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("kvboost_request_seconds", "Request latency, submission to last token",
                             buckets=_LATENCY, registry=r)
        self.step = Histogram("kvboost_decode_step_seconds", "One batched decode step",
                              buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0), registry=r)
        self.reuse = Histogram("kvboost_reuse_ratio", "Share of each prompt's tokens served from the KV cache "
                               "and used as is, exact or approximate (the engine's reuse_ratio)",
                               buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 1.0), registry=r)
        self.prompt_tokens = Counter("kvboost_prompt_tokens", "Prompt tokens prefilled", registry=r)
        # the one definition of kvboost_core.CacheCounts, as usage.prompt_tokens_details reports it
        self.cached_tokens = Counter("kvboost_cached_prompt_tokens", "Prompt tokens served from exact cached KV "
                                     "(a prefix hit or a block adapter's own prefill): usage's cached_tokens",
                                     registry=r)
        self.approximate_tokens = Counter("kvboost_approximate_prompt_tokens", "Prompt tokens served from "
                                          "approximate KV kept without recompute (re-placed documents, repaired "
                                          "prefixes), never in kvboost_cached_prompt_tokens", registry=r)
        self.generated = Counter("kvboost_generated_tokens", "Tokens generated", registry=r)
        self.decode_tokens = Counter("kvboost_decode_tokens", "Tokens produced by batched decode steps "
                                     "(with kvboost_decode_step_seconds_sum: decode throughput)", registry=r)
        self.requests = Counter("kvboost_requests", "Finished HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=r)
        self.queue = Gauge("kvboost_queue_depth", "Requests waiting for a batch slot", registry=r)
        self.running = Gauge("kvboost_running_requests", "Requests in the decode batch", registry=r)
        self.tps = Gauge("kvboost_tokens_per_second", "Generated tokens per second over the last steps",
                         registry=r)
        self.batch_bytes = Gauge("kvboost_batch_kv_bytes", "Bytes of the decode batch's KV buffers", registry=r)
        self.pages = Gauge("kvboost_kv_pages", "Pages of the KV pool (serve --kv-pool) by state: used, shared "
                           "(held by several requests), free", ["state"], registry=r)
        self.cache_bytes = Gauge("kvboost_cache_bytes", "Bytes held by the KV store, per tier and namespace",
                                 ["namespace", "tier"], registry=r)
        self.backfill_pending = Gauge("kvboost_backfill_pending", "Chat turns whose history backfill is queued",
                                      registry=r)
        self.backfill_tokens = Gauge("kvboost_backfill_computed_tokens", "Tokens chat-history backfills computed "
                                     "(exact canonical prefill, between requests) since the server started",
                                     registry=r)
        self.backfill_dropped = Gauge("kvboost_backfill_dropped", "Chat backfills dropped unrun past the queue's "
                                      "bounds (that chat's next request computes its history)", registry=r)
        self.cache_entries = Gauge("kvboost_cache_entries", "Entries in the KV store, per tier and namespace",
                                   ["namespace", "tier"], registry=r)

    # called from the engine thread
    def on_start(self, ttft_s: float, prompt_tokens: int, counts: CacheCounts) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(counts.cached)
        self.approximate_tokens.inc(counts.approximate)
        self.reuse.observe((counts.cached + counts.approximate) / max(prompt_tokens, 1))

    def on_finish(self, seconds: float, tokens: int) -> None:
        self.e2e.observe(seconds)
        self.generated.inc(tokens)

    def on_step(self, seconds: float, batch: int) -> None:
        self.step.observe(seconds)
        self.decode_tokens.inc(batch)

    def render(self, scheduler: Any, stores: Callable[[], dict[str, dict[str, Any]]]) -> bytes:
        self.queue.set(scheduler.queue_depth)
        self.running.set(scheduler.running)
        self.tps.set(scheduler.tokens_per_second())
        self.batch_bytes.set(scheduler.decoder.nbytes)
        pool = getattr(scheduler.decoder, "pool", None)
        if pool is not None:
            stats = pool.stats()
            for state, value in (("used", stats.used), ("shared", stats.shared), ("free", stats.free)):
                self.pages.labels(state).set(value)
        totals = scheduler.backfills.totals
        self.backfill_pending.set(totals.pending)
        self.backfill_tokens.set(totals.tokens)
        self.backfill_dropped.set(totals.dropped)
        for ns, stats in stores().items():
            for tier, (nbytes, entries) in tier_bytes(stats).items():
                self.cache_bytes.labels(ns, tier).set(nbytes)
                self.cache_entries.labels(ns, tier).set(entries)
        return generate_latest(self.registry)


def tier_bytes(stats: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{tier: (bytes, entries)} from a store's stats: a tiered store reports ``<tier>.bytes``; a single tier
    reports ``bytes``."""
    out = {}
    for key, value in stats.items():
        if key.endswith(".bytes") and isinstance(value, int):
            tier = key[: -len(".bytes")]
            out[tier] = (value, int(stats.get(f"{tier}.entries", 0) or 0))
    if not out and isinstance(stats.get("bytes"), int):
        out["memory"] = (int(stats["bytes"]), int(stats.get("entries", 0) or 0))
    return out
