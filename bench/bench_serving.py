"""Serving benchmark: the server over HTTP against plain `model.generate`, on the same prompts and token counts.

    .venv/bin/python bench/bench_serving.py                  # HTTP at 1, 8, 32, 64 streams + generate baseline
    .venv/bin/python bench/bench_serving.py --concurrency 1 8
    .venv/bin/python bench/bench_serving.py --step-context    # decode step time at context 128 vs 2048, batch 8
    .venv/bin/python bench/bench_serving.py --ab-tree ../old  # this tree's server against another checkout's
    .venv/bin/python bench/bench_serving.py --ab-tree ../old --sampled  # ... streams sampling (T 0.8, top_p 0.95)
    .venv/bin/python bench/bench_serving.py --ab-flags "--kv-disk-gib 0"  # this tree against itself with flags
    .venv/bin/python bench/bench_serving.py --prefill 15 255 1000  # first token of one prompt, idle engine
    .venv/bin/python bench/bench_serving.py --constrained 8 --concurrency 32  # 8 of 32 streams JSON-constrained
    .venv/bin/python bench/bench_serving.py --max-batch-sizes 32 64 128 --concurrency 32 64 128  # candidates

The server is started as a user would start it (`python -m app`). Each client streams one greedy request of
`--new-tokens` tokens with `ignore_eos` (`--sampled`: temperature 0.8, top_p 0.95, as chat clients send).
Reported: aggregate tokens/s, time to first token and inter-token latency (p50/p99), the server's mean engine
step and peak RSS, and the benchmark's own CPU time, during that concurrency level; then the offline baseline, a
static batch of the same size through `model.generate`, and the ratio. Each side runs every level `--repeats`
times (3), the two sides alternating, and reports its median
run: this machine drifts by 15-20% between runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import resource
import shlex
import statistics
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from compat.conftest import start_server, stop_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["a lighthouse", "the moon", "a small robot", "an old map", "the ocean", "a mountain town", "a violin", "rain"]


_RUNS = iter(range(10**9))


def prompts(n: int) -> list[str]:
    """``n`` distinct prompts, distinct from every earlier call's too (each starts with a run number): with the
    prefix cache on, a repeated run must not find its prompts cached."""
    run = next(_RUNS)
    return [f"Run {run}. Write a short story about {TOPICS[i % len(TOPICS)]} (story {i}):" for i in range(n)]


@dataclass
class StreamTiming:
    start: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0


# A JSON object whose one string must be long: a constrained stream stays in the grammar's string state (the
# widest masks) for all its tokens, and runs to max_tokens like the free ones.
LONG_STRING = {
    "type": "json_schema",
    "json_schema": {
        "name": "story",
        "schema": {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 5000}},
            "required": ["story"],
        },
    },
}


#: Extra request fields for every stream: `--sampled` sets what chat clients commonly send.
SAMPLING: dict[str, float] = {}


async def one_stream(
    client: httpx.AsyncClient, base: str, prompt: str, new_tokens: int, constrained: bool = False
) -> StreamTiming:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": new_tokens,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,  # greedy, as the `generate` baseline
        "stream_options": {"include_usage": True},
        **SAMPLING,
    }
    if constrained:
        body["response_format"] = LONG_STRING
    timing = StreamTiming(time.perf_counter())
    async with client.stream("POST", f"{base}/v1/completions", json=body) as response:
        async for chunk in sse_chunks(response):
            if chunk["choices"]:
                timing.chunks.append(time.perf_counter())
            if chunk.get("usage"):  # llama.cpp's server sends it on its last chunk with choices
                timing.tokens = chunk["usage"]["completion_tokens"]
    return timing


async def sse_chunks(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of a streamed response (its status checked), up to ``[DONE]``."""
    response.raise_for_status()
    async for line in response.aiter_lines():
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[6:])


class RssSampler:
    """Samples a process's resident memory from /proc while a run goes on."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak_kib = max(self.peak_kib, self.rss_kib())
            time.sleep(0.05)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_level(base: str, n: int, new_tokens: int, constrained: int = 0) -> dict[str, float]:
    """``n`` streams at once, the first ``constrained`` of them JSON-schema constrained."""
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        started = time.perf_counter()
        streams = [one_stream(client, base, p, new_tokens, i < constrained) for i, p in enumerate(prompts(n))]
        timings = await asyncio.gather(*streams)
        wall = time.perf_counter() - started
    assert all(t.tokens == new_tokens for t in timings), [t.tokens for t in timings]
    ttft = [t.chunks[0] - t.start for t in timings]
    itl = [b - a for t in timings for a, b in zip(t.chunks, t.chunks[1:], strict=False)]
    return {
        "tok_s": n * new_tokens / wall,
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "itl_p50": pct(itl, 0.5),
        "itl_p99": pct(itl, 0.99),
    }


def step_totals(base: str) -> tuple[float, float]:
    """The server's engine-step histogram so far: (seconds in steps, number of steps), over every replica."""
    text = httpx.get(f"{base}/metrics").text
    total, count = (
        sum(float(v) for v in re.findall(rf"^smolserve:engine_step_seconds_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))
        for name in ("sum", "count")
    )
    return total, count


def median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput, latencies and all (an odd count of runs)."""
    return sorted(runs, key=lambda run: run["tok_s"])[len(runs) // 2]


def compare(
    levels: list[int], new_tokens: int, server_args: list[str], repeats: int, baseline: Baseline
) -> tuple[dict[int, dict[str, float]], dict[int, float]]:
    """Each level's HTTP runs and `generate` runs, alternated so that both sides see the same drift of this
    machine; the server sits idle while `generate` runs. Returns the median run of each side."""
    flags = ["--model", MODEL, "--max-batch-size", str(max(levels)), "--log-level", "warning", *server_args]
    proc, base = start_server(*flags)
    http, offline = {}, {}
    try:
        asyncio.run(run_level(base, 2, 8))  # warm-up
        for n in levels:
            http_runs, offline_runs = [], []
            for _ in range(repeats):
                # The server sat idle while `generate` ran; a short burst first, so that the run measures
                # serving at this concurrency rather than the first burst after a pause (slower here, see
                # bench/README.md).
                asyncio.run(run_level(base, n, 8))
                http_runs.append(measure_level(proc.pid, base, n, new_tokens))
                offline_runs.append(baseline.tok_s(n, new_tokens))
            http[n], offline[n] = median_run(http_runs), sorted(offline_runs)[repeats // 2]
    finally:
        stop_server(proc)
    return http, offline


def compare_trees(
    levels: list[int], new_tokens: int, server_args: list[str], repeats: int, other: Path | None,
    other_flags: list[str] = [],  # noqa: B006 - read only
) -> dict[str, dict[int, dict[str, float]]]:  # fmt: skip
    """This tree's server and ``other``'s (another checkout: the code before a change; None: this tree again),
    the second with ``other_flags`` added, both up, their runs of each level alternated so that both see the same
    drift of this machine. Returns each side's median runs."""
    flags = ["--model", MODEL, "--max-batch-size", str(max(levels)), "--log-level", "warning", *server_args]
    name = " ".join([str(other or "this tree"), *other_flags])
    root = ROOT if other is None else other.resolve()
    servers = {"this tree": start_server(*flags), name: start_server(*flags, *other_flags, root=root)}
    results: dict[str, dict[int, dict[str, float]]] = {name: {} for name in servers}
    try:
        for _, base in servers.values():
            asyncio.run(run_level(base, 2, 8))  # warm-up
        for n in levels:
            runs: dict[str, list[dict[str, float]]] = {name: [] for name in servers}
            for _ in range(repeats):
                for name, (proc, base) in servers.items():
                    asyncio.run(run_level(base, n, 8))  # a short burst first, as in `compare`
                    print(f"  [{name}]", end="")
                    runs[name].append(measure_level(proc.pid, base, n, new_tokens))
            for name in servers:
                results[name][n] = median_run(runs[name])
    finally:
        for proc, _ in servers.values():
            stop_server(proc)
    return results


def compare_batch_sizes(levels: list[int], new_tokens: int, sizes: list[int], repeats: int) -> None:
    """The server at each ``--max-batch-size`` candidate (one after another: only one is up at a time), its
    median run of every level: throughput, TTFT and ITL."""
    print("| max batch size | streams | tok/s | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | mean step (ms) |")
    print("|---|---|---|---|---|---|")
    for size in sizes:
        proc, base = start_server("--model", MODEL, "--max-batch-size", str(size), "--log-level", "warning")
        try:
            asyncio.run(run_level(base, 2, 8))  # warm-up
            for n in levels:
                runs = []
                for _ in range(repeats):
                    asyncio.run(run_level(base, n, 8))  # a short burst first, as in `compare`
                    runs.append(measure_level(proc.pid, base, n, new_tokens))
                r = median_run(runs)
                print(
                    f"| {size} | {n} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | "
                    f"{r['itl_p50'] * 1000:.0f} / {r['itl_p99'] * 1000:.0f} | {r['step_ms']:.1f} |",
                    flush=True,
                )
        finally:
            stop_server(proc)


def compare_constrained(n: int, constrained: int, new_tokens: int, server_args: list[str], repeats: int) -> None:
    """``n`` free streams against ``n`` streams of which ``constrained`` carry a JSON schema, alternated on one
    server; prints each side's median run and the ratio."""
    flags = ["--model", MODEL, "--max-batch-size", str(n), "--log-level", "warning", *server_args]
    proc, base = start_server(*flags)
    runs: dict[int, list[dict[str, float]]] = {0: [], constrained: []}
    try:
        asyncio.run(run_level(base, 2, 8, constrained=1))  # warm-up, the grammar compiled once
        for _ in range(repeats):
            for share in runs:
                asyncio.run(run_level(base, n, 8, share))
                print(f"  [{share} of {n} constrained]", end="")
                runs[share].append(measure_level(proc.pid, base, n, new_tokens, share))
    finally:
        stop_server(proc)
    free, mixed = median_run(runs[0]), median_run(runs[constrained])
    print(
        f"{n} streams: {free['tok_s']:.1f} tok/s free, {mixed['tok_s']:.1f} tok/s with {constrained} constrained: "
        f"{mixed['tok_s'] / free['tok_s']:.3f}x; mean step {free['step_ms']:.1f} vs {mixed['step_ms']:.1f} ms"
    )


def measure_level(pid: int, base: str, n: int, new_tokens: int, constrained: int = 0) -> dict[str, float]:
    steps_before, cpu_before = step_totals(base), resource.getrusage(resource.RUSAGE_SELF)
    with RssSampler(pid) as rss:
        result = asyncio.run(run_level(base, n, new_tokens, constrained))
    steps_after, cpu_after = step_totals(base), resource.getrusage(resource.RUSAGE_SELF)
    result["peak_rss_mib"] = rss.peak_kib / 1024
    result["step_ms"] = 1000 * (steps_after[0] - steps_before[0]) / (steps_after[1] - steps_before[1])
    result["client_cpu_s"] = (cpu_after.ru_utime + cpu_after.ru_stime) - (cpu_before.ru_utime + cpu_before.ru_stime)
    print(f"  http n={n}: {result['tok_s']:.1f} tok/s", flush=True)
    return result


class Baseline:
    """Plain `model.generate` on static batches of the benchmark's prompts, in this process."""

    def __init__(self, dtype: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from engine.runtime import loader

        source = str(loader._converted(loader._default_gguf()))
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        self.tokenizer.padding_side = "left"
        self.model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, dtype)).eval()
        self.dtype = dtype
        self._warm: set[int] = set()

    def tok_s(self, n: int, new_tokens: int) -> float:
        import torch

        batch = self.tokenizer(prompts(n), return_tensors="pt", padding=True)
        with torch.inference_mode():
            if n not in self._warm:
                self.model.generate(**batch, max_new_tokens=2, do_sample=False)
                self._warm.add(n)
            started = time.perf_counter()
            out = self.model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            result = n * new_tokens / (time.perf_counter() - started)
        assert out.shape[1] - batch["input_ids"].shape[1] == new_tokens
        print(f"  generate ({self.dtype}) n={n}: {result:.1f} tok/s", flush=True)
        return result


def step_context(kv_cache_dtype: str = "auto", batch: int = 8, contexts: tuple[int, ...] = (128, 2048)) -> None:
    """Decode step time for `batch` sequences whose contexts hold `context` tokens. One engine per context,
    built from the same loaded model, stepped in turn (a step of each, `STEPS` times) so that every context
    sees the same state of this machine, whose speed drifts by 15-30% from one minute to the next; the median
    steps are compared. All on one thread, as the server steps its engine (a second OpenMP team slows every
    step)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as engine_thread:
        times = engine_thread.submit(_step_times, kv_cache_dtype, batch, contexts).result()
    median = {context: statistics.median(values) for context, values in times.items()}
    for context, values in times.items():
        quartiles = statistics.quantiles(values, n=4)
        print(
            f"  batch {batch}, context {context}: median {median[context]:.1f} ms/step (quartiles "
            f"{quartiles[0]:.1f} / {quartiles[2]:.1f}) over {len(values)} steps"
        )
    first, last = contexts[0], contexts[-1]
    print(
        f"median step: context {first} {median[first]:.1f} ms, context {last} {median[last]:.1f} ms; "
        f"ratio {median[last] / median[first]:.2f}x"
    )


STEPS = 60


def prefill(lengths: list[int]) -> None:
    """Time to the first token of one prompt of each length on an idle engine (the server's step budget), the
    median of several; on the engine's own thread, as the server runs it."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as engine_thread:
        for length, millis in engine_thread.submit(_prefill_times, lengths).result().items():
            print(f"  prompt of {length} tokens: first token after {millis:.1f} ms (median)")


def _prefill_times(lengths: list[int]) -> dict[int, float]:
    from engine.core.config import EngineConfig
    from engine.core.types import GenerationRequest
    from engine.runtime import loader
    from engine.runtime.batch_engine import HFEngine

    loaded = loader.load(MODEL, "auto")
    config = EngineConfig()
    engine = HFEngine(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        capacity=8,
        max_model_len=max(lengths) + 8,
        kv_cache_bytes=int(config.kv_cache_gib * 2**30),
        max_num_batched_tokens=config.max_num_batched_tokens,
        prefix_caching=False,  # the same prompts again and again: each must be prefilled
    )

    def first_token_ms(length: int) -> float:
        engine.admit([GenerationRequest(tuple(range(1000, 1000 + length)), 1, ignore_eos=True)])
        began = time.perf_counter()
        while engine.num_active():
            engine.step()
        return (time.perf_counter() - began) * 1000

    for _ in range(3):
        first_token_ms(min(lengths))  # warm-up
    return {n: statistics.median(first_token_ms(n) for _ in range(7 if n < 500 else 3)) for n in lengths}


def _step_times(kv_cache_dtype: str, batch: int, contexts: tuple[int, ...]) -> dict[int, list[float]]:
    from engine.core.config import EngineConfig
    from engine.core.types import GenerationRequest
    from engine.runtime import loader
    from engine.runtime.batch_engine import HFEngine

    loaded = loader.load(MODEL, "auto")
    engines = {}
    for context in contexts:
        engine = HFEngine(
            loaded.model,
            eos_token_ids=loaded.eos_token_ids,
            capacity=batch,
            max_model_len=context + STEPS + 8,
            kv_cache_bytes=int(EngineConfig().kv_cache_gib * 2**30),
            max_num_batched_tokens=4096,
            kv_cache_dtype=kv_cache_dtype,
        )
        prompts = [tuple((i * 7919 + j * 31) % 40000 + 100 for j in range(context)) for i in range(batch)]
        engine.admit([GenerationRequest(prompt, STEPS + 4, ignore_eos=True) for prompt in prompts])
        started: set[int] = set()
        while len(started) < batch:  # prefill, until every sequence has its first token
            started.update(out.seq_id for out in engine.step())
        engine.step()
        engines[context] = engine
    times: dict[int, list[float]] = {context: [] for context in contexts}
    for _ in range(STEPS):
        for context, engine in engines.items():
            began = time.perf_counter()
            engine.step()
            times[context].append((time.perf_counter() - began) * 1000)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--baseline-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="extra flags for python -m app")
    parser.add_argument(
        "--repeats", type=int, default=3, help="runs of each level on each side; the median run is reported (odd)"
    )
    parser.add_argument("--step-context", action="store_true", help="only the decode-step-vs-context measurement")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"], help="for --step-context")
    parser.add_argument("--prefill", type=int, nargs="+", metavar="TOKENS", help="only time-to-first-token of prompts")
    parser.add_argument("--constrained", type=int, default=0, metavar="K", help="only: K streams JSON-constrained")
    parser.add_argument("--ab-tree", type=Path, default=None, help="another checkout to serve and compare against")
    parser.add_argument("--ab-flags", default="", help="flags for the second server of --ab-tree (or of this tree)")
    parser.add_argument("--sampled", action="store_true", help="streams sample (temperature 0.8, top_p 0.95)")
    parser.add_argument(
        "--max-batch-sizes", type=int, nargs="+", default=None, help="only: the server at each of these batch sizes"
    )
    args = parser.parse_args()
    if args.sampled:
        SAMPLING.update(temperature=0.8, top_p=0.95)
    if args.max_batch_sizes:
        compare_batch_sizes(args.concurrency, args.new_tokens, args.max_batch_sizes, args.repeats)
        return
    if args.step_context:
        step_context(args.kv_cache_dtype)
        return
    if args.prefill:
        prefill(args.prefill)
        return
    if args.constrained:
        n = max(args.concurrency)
        compare_constrained(n, args.constrained, args.new_tokens, args.server_args, args.repeats)
        return
    if args.ab_tree is not None or args.ab_flags:
        ab = compare_trees(args.concurrency, args.new_tokens, args.server_args, args.repeats, args.ab_tree,
                           shlex.split(args.ab_flags))  # fmt: skip
        print_ab(args.concurrency, ab)
        return
    print("serving over HTTP, alternated with plain generate on static batches:", flush=True)
    baseline = Baseline(args.baseline_dtype)
    http, base = compare(args.concurrency, args.new_tokens, args.server_args, args.repeats, baseline)
    print()
    print(
        "| streams | HTTP tok/s | generate tok/s | ratio | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) "
        "| mean step (ms) | client CPU (s) | peak RSS (MiB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in args.concurrency:
        r = http[n]
        print(
            f"| {n} | {r['tok_s']:.1f} | {base[n]:.1f} | {r['tok_s'] / base[n]:.2f}x | "
            f"{r['ttft_p50']:.2f} / {r['ttft_p99']:.2f} | {r['itl_p50'] * 1000:.0f} / {r['itl_p99'] * 1000:.0f} | "
            f"{r['step_ms']:.1f} | {r['client_cpu_s']:.1f} | {r['peak_rss_mib']:.0f} |"
        )


def print_ab(levels: list[int], ab: dict[str, dict[int, dict[str, float]]]) -> None:
    (this, this_runs), (other, other_runs) = ab.items()
    print(f"\n| streams | {this} tok/s | {other} tok/s | ratio | TTFT p50 (s) | ITL p50 / p99 (ms) | mean step (ms) |")
    print("|---|---|---|---|---|---|---|")
    for n in levels:
        a, b = this_runs[n], other_runs[n]
        print(
            f"| {n} | {a['tok_s']:.1f} | {b['tok_s']:.1f} | {a['tok_s'] / b['tok_s']:.3f}x | "
            f"{a['ttft_p50']:.2f} vs {b['ttft_p50']:.2f} | {a['itl_p50'] * 1000:.0f} / {a['itl_p99'] * 1000:.0f} vs "
            f"{b['itl_p50'] * 1000:.0f} / {b['itl_p99'] * 1000:.0f} | {a['step_ms']:.1f} vs {b['step_ms']:.1f} |"
        )


if __name__ == "__main__":
    main()
