"""Prometheus metrics, one registry per app (so several apps in one process, as in tests, do not collide)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from app.stores.batch_store import STATUSES
from engine.core.streams import Delta
from engine.core.types import MemoryStats

PREFIX = "smolserve:"
_STEP_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
    """The request-side series (tokens, outcomes, latencies). The engine-side ones (batch, steps, KV memory) come
    from the backend: ``EngineMetrics`` in one process, every replica's, labelled, on a cluster."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Tokens generated", registry=r)
        self.request_success = Counter(
            f"{PREFIX}request_success", "Requests that finished", ["finish_reason"], registry=r
        )
        self.http_responses = Counter(
            f"{PREFIX}http_responses", "HTTP responses by route and status", ["route", "status"], registry=r
        )
        self.requests_rejected = Counter(
            f"{PREFIX}requests_rejected", "Requests answered with an error", ["reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            f"{PREFIX}time_to_first_token_seconds", "Arrival to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.inter_token_latency = Histogram(
            f"{PREFIX}inter_token_latency_seconds",
            "Gap between a request's tokens",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e_latency = Histogram(
            f"{PREFIX}e2e_request_latency_seconds", "Arrival to last token", buckets=_LATENCY_BUCKETS, registry=r
        )

    def observe_response(self, path: str, status: int) -> None:
        self.http_responses.labels(_route(path), str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def observe(self, deltas: AsyncIterator[Delta], arrived: float) -> AsyncIterator[Delta]:
        """Pass ``deltas`` through, timing them; count the request when it finishes."""
        last = None
        async for delta in deltas:
            now = time.perf_counter()
            if last is None:
                self.time_to_first_token.observe(now - arrived)
            else:
                self.inter_token_latency.observe(now - last)
            last = now
            self.generation_tokens.inc(len(delta.token_ids))
            if delta.finish_reason is not None:
                self.e2e_latency.observe(now - arrived)
                self.request_success.labels(delta.finish_reason).inc()
            yield delta


class EngineMetrics:
    """One engine's series: its batch and queue (read when scraped), its steps, its KV memory."""

    def __init__(
        self,
        registry: CollectorRegistry,
        num_running: Callable[[], int],
        num_waiting: Callable[[], int],
        memory_stats: Callable[[], MemoryStats | None] = lambda: None,
        runtime_info: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        r = registry
        r.register(_MemoryCollector(memory_stats))
        r.register(_RuntimeCollector(runtime_info))
        Gauge(f"{PREFIX}num_requests_running", "Requests in the engine's batch", registry=r).set_function(num_running)
        Gauge(f"{PREFIX}num_requests_waiting", "Requests waiting for a batch slot", registry=r).set_function(
            num_waiting
        )
        self.engine_step = Histogram(
            f"{PREFIX}engine_step_seconds", "Duration of one engine step", buckets=_STEP_BUCKETS, registry=r
        )
        self.engine_step_batch = Histogram(
            f"{PREFIX}engine_step_batch_size", "Sequences in one engine step", buckets=_BATCH_BUCKETS, registry=r
        )

    def observe_step(self, seconds: float, batch_size: int) -> None:
        self.engine_step.observe(seconds)
        self.engine_step_batch.observe(batch_size)


class _MemoryCollector(Collector):
    """The engine's KV blocks (gauges) and its prefix-cache and preemption counts (counters, named as vLLM's),
    read from the engine when scraped. Nothing for an engine without block memory."""

    def __init__(self, memory_stats: Callable[[], MemoryStats | None]) -> None:
        self._memory_stats = memory_stats

    def collect(self) -> Iterator[Metric]:
        stats = self._memory_stats()
        if stats is None:
            return
        gauges = {
            "kv_blocks_in_use": ("KV cache blocks held by running sequences", stats.blocks_in_use),
            "kv_blocks_cached": ("KV cache blocks held only by the prefix cache (evictable)", stats.blocks_cached),
            "kv_blocks_free": ("KV cache blocks holding nothing", stats.blocks_free),
            "kv_cache_usage_perc": ("Fraction of KV blocks in use", stats.blocks_in_use / max(stats.num_blocks, 1)),
        }
        for name, (documentation, value) in gauges.items():
            yield GaugeMetricFamily(f"{PREFIX}{name}", documentation, value=value)
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache", stats.prefix_queried_tokens),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache", stats.prefix_hit_tokens),
            "num_preemptions": (
                "Sequences preempted for want of KV blocks or slots (parked for more urgent ones)",
                stats.preemptions,
            ),
            "spec_decode_num_drafts": ("Drafts verified by speculative decoding", stats.drafts),
            "spec_decode_num_draft_tokens": ("Tokens drafted by speculative decoding", stats.drafted_tokens),
            "spec_decode_num_accepted_tokens": ("Drafted tokens the model accepted", stats.accepted_tokens),
        }
        for name, (documentation, value) in counters.items():
            yield CounterMetricFamily(f"{PREFIX}{name}", documentation, value=value)
        if stats.disk is not None:
            yield from _disk_metrics(stats.disk)


def _disk_metrics(disk: dict[str, Any]) -> Iterator[Metric]:
    """The prefix cache's disk tier: what it holds and may hold (gauges), what it found, restored and wrote."""
    gauges = {
        "kv_disk_blocks": ("KV blocks kept on disk", disk["blocks"]),
        "kv_disk_bytes": ("Bytes of KV blocks kept on disk", disk["bytes"]),
        "kv_disk_max_bytes": ("The most the disk tier may hold (--kv-disk-gib)", disk["max_bytes"]),
        "kv_disk_read_seconds_per_block": (
            "Seconds a block takes to read from disk (a moving average)",
            disk["read_seconds_per_block"],
        ),
        "kv_disk_prefill_seconds_per_block": (
            "Seconds a block takes to prefill, against which a read is chosen (a moving average; NaN until measured)",
            disk["prefill_seconds_per_block"] or float("nan"),
        ),
    }
    for name, (documentation, value) in gauges.items():
        yield GaugeMetricFamily(f"{PREFIX}{name}", documentation, value=value)
    counters = {
        "prefix_cache_disk_hits": ("Prompt tokens found in the prefix cache's disk tier", disk["hit_tokens"]),
        "kv_disk_restored_blocks": ("KV blocks read back from disk", disk["restored_blocks"]),
        "kv_disk_restore_seconds": ("Seconds spent reading KV blocks back from disk", disk["restore_seconds"]),
        "kv_disk_written_blocks": ("KV blocks written to disk", disk["written_blocks"]),
        "kv_disk_dropped_writes": ("KV blocks not written: the writer was behind", disk["dropped_writes"]),
        "kv_disk_corrupt_files": ("Torn or corrupt block files found and removed", disk["corrupt_files"]),
        "kv_disk_lookups_skipped": (
            "Prefixes prefilled, not read: prefilling a block was measured faster",
            disk["lookups_skipped"],
        ),
    }
    for name, (documentation, value) in counters.items():
        yield CounterMetricFamily(f"{PREFIX}{name}", documentation, value=value)


class _RuntimeCollector(Collector):
    """How the engine computes, read when scraped: the threads its team runs now (they follow the CPUs other
    processes leave free) and the most it may run. Nothing for an engine that does not say."""

    def __init__(self, runtime_info: Callable[[], dict[str, Any]]) -> None:
        self._runtime_info = runtime_info

    def collect(self) -> Iterator[Metric]:
        info = self._runtime_info()
        if "threads" in info:
            yield GaugeMetricFamily(f"{PREFIX}num_threads", "Threads in the engine's team now", value=info["threads"])
            yield GaugeMetricFamily(f"{PREFIX}max_threads", "Most threads the team may run", value=info["max_threads"])
        if "batch_invariant" in info:
            invariant = float(info["batch_invariant"])
            yield GaugeMetricFamily(f"{PREFIX}batch_invariant", "1 when a row's result never depends on its batch",
                                    value=invariant)  # fmt: skip


class BatchCollector(Collector):
    """The Batch API's queue, read when scraped (``BatchRunner.report``): batches by status, lines running and
    waiting their turn, lines finished since the server started by outcome."""

    def __init__(self, report: Callable[[], dict[str, Any]]) -> None:
        self._report = report

    def collect(self) -> Iterator[Metric]:
        report = self._report()
        batches = GaugeMetricFamily(f"{PREFIX}batches", "Batches by status", labels=["status"])
        for status in STATUSES:
            batches.add_metric([status], report["by_status"].get(status, 0))
        yield batches
        yield GaugeMetricFamily(f"{PREFIX}batch_lines_running", "Batch lines in the server now",
                                value=report["lines_running"])  # fmt: skip
        yield GaugeMetricFamily(f"{PREFIX}batch_lines_waiting", "Lines of unfinished batches not started yet",
                                value=report["lines_waiting"])  # fmt: skip
        lines = CounterMetricFamily(f"{PREFIX}batch_lines", "Batch lines finished, by outcome", labels=["outcome"])
        for outcome, count in sorted(report["lines_finished"].items()):
            lines.add_metric([outcome], count)
        yield lines


#: The routes responses are counted by; a path with an id is counted under its route, any other path as "other".
_ROUTES = (
    "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/tokenize",
    "/detokenize", "/tokenizer_info", "/health", "/metrics",
)  # fmt: skip


def _route(path: str) -> str:
    if path in _ROUTES:
        return path
    for prefix in ("/v1/responses/", "/v1/models/"):
        if path.startswith(prefix):
            return prefix + "{id}"
    return "other"
