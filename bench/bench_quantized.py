"""The default GGUF's own quantized blocks (`--quantization auto`, the default, which takes them) against its
dequantized weights (`--quantization none`), and llama.cpp's server on the same file.

    .venv/bin/python bench/bench_quantized.py                    # quality, and decode step times by batch size
    .venv/bin/python bench/bench_quantized.py --http --llama-server "$(../shared/tools/build-llama-server.sh)"
    .venv/bin/python bench/bench_quantized.py --alternate 8 --llama-server "$(../shared/tools/build-llama-server.sh)"
    .venv/bin/python bench/bench_quantized.py --long-prompts 250 1000 2000 --llama-server "$(...)"

Quality (float32 activations): perplexity of both paths over a fixed text (Python's reference documentation as
installed with Python, `pydoc_data.topics`: the first `--ppl-tokens` (16,384) tokens, in windows of 512; over
4,096 tokens the native path's perplexity moved by 0.3% between two runs of equal quality: the 8-bit rounding's
noise), and how many of twelve prompts' greedy continuations agree on their first 16 tokens. Steps: the median
decode step at each batch size, the two engines stepped in turn. HTTP: closed-loop streaming clients, 64 greedy
tokens each (ignore_eos), at 1/8/32/64 streams, the median of `--repeats` runs per level; each server alone on the
machine in turn; the server's resident set size after a warm-up (idle) and its peak during each level.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import RssSampler, median_run, run_level  # noqa: E402
from llama import start_llama  # noqa: E402
from record import write_results  # noqa: E402

from compat.conftest import start_server, stop_server  # noqa: E402

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = [
    "The capital of France is", "Once upon a time", "def fibonacci(n):", "Hi", "List three colors:",
    "In 1969, astronauts", "The quick brown fox jumps over the lazy dog.", "Translate to French: cheese",
    "import numpy as np\nx = np.", "Water boils at", "My favourite book is", "Q: What is 2 + 2?\nA:",
]  # fmt: skip


def engines(batch: int = 32) -> tuple[Any, dict[str, Any]]:
    from engine.runtime import gguf_weights, loader
    from engine.runtime.batch_engine import HFEngine

    loaded = loader.load(MODEL)
    config = loaded.model.config
    quantized = gguf_weights.read(loaded.gguf, config.num_attention_heads, config.num_key_value_heads)
    built = {
        name: HFEngine(
            loaded.model,
            eos_token_ids=loaded.eos_token_ids,
            capacity=batch,
            max_model_len=1024,
            kv_cache_bytes=1 << 30,
            max_num_batched_tokens=512,
            prefix_caching=False,
            quantized=weights,
        )
        for name, weights in (("none", None), ("native", quantized))
    }
    return loaded, built


def run(engine: Any, requests: list[Any]) -> list[list[Any]]:
    ids = engine.admit(requests)
    outputs = {seq_id: [] for seq_id in ids}
    while engine.num_active():
        for out in engine.step():
            outputs[out.seq_id].append(out)
    return [outputs[seq_id] for seq_id in ids]


def quality(ppl_tokens: int) -> None:
    import pydoc_data.topics

    from engine.core.types import GenerationRequest

    loaded, built = engines()
    text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
    tokens = loaded.tokenizer.encode(text)[:ppl_tokens]
    windows = [tuple(tokens[i : i + 512]) for i in range(0, len(tokens), 512)]
    greedy = {}
    for name, engine in built.items():
        scored = run(engine, [GenerationRequest(w, 1, prompt_logprobs=0) for w in windows])
        logprobs = [entry.logprob for outs in scored for entry in outs[0].prompt_logprobs[1:]]
        print(f"{name}: perplexity {math.exp(-statistics.fmean(logprobs)):.4f} over {len(logprobs)} tokens")
        prompts = [GenerationRequest(tuple(loaded.tokenizer.encode(p)), 16, ignore_eos=True) for p in PROMPTS]
        greedy[name] = [[t for out in outs for t in out.token_ids] for outs in run(engine, prompts)]
    agree = [a == b for a, b in zip(greedy["none"], greedy["native"], strict=True)]
    first_differences = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 16)
                         for a, b in zip(greedy["none"], greedy["native"], strict=True)]  # fmt: skip
    print(
        f"greedy: {sum(agree)} of {len(agree)} prompts agree on all 16 tokens; first difference at {first_differences}"
    )


def steps(batches: list[int], count: int = 40) -> None:
    from engine.core.types import GenerationRequest

    _, built = engines(max(batches))
    for batch in batches:
        times: dict[str, list[float]] = {name: [] for name in built}
        for engine in built.values():
            engine.admit(
                [GenerationRequest(tuple(range(100 + i, 130 + i)), count + 8, ignore_eos=True) for i in range(batch)]
            )
            for _ in range(4):
                engine.step()
        for _ in range(count):
            for name, engine in built.items():
                began = time.perf_counter()
                engine.step()
                times[name].append((time.perf_counter() - began) * 1000)
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"batch {batch}: decode step none {medians['none']:.1f} ms, native {medians['native']:.1f} ms "
              f"({medians['none'] / medians['native']:.2f}x)", flush=True)  # fmt: skip
        for engine in built.values():
            engine.reset()


def http(levels: list[int], repeats: int, llama_server: str | None, out: Path | None = None) -> None:
    targets: list[tuple[str, list[str] | str]] = [
        ("smolserve none", ["--quantization", "none"]),
        ("smolserve auto (default: native)", []),
    ]
    if llama_server:
        targets.append(("llama.cpp", llama_server))
    print("| server | streams | tok/s | TTFT p50 (s) | ITL p50 / p99 (ms) | RSS idle / peak (MiB) |")
    print("|---|---|---|---|---|---|")
    rows: list[dict[str, Any]] = []
    for name, spec in targets:
        if isinstance(spec, str):
            proc, base = start_llama(spec, max(levels))
        else:
            proc, base = start_server("--model", MODEL, "--log-level", "warning", *spec)
        try:
            asyncio.run(run_level(base, 2, 8))  # warm-up
            idle = RssSampler(proc.pid).rss_kib() / 1024
            for n in levels:
                with RssSampler(proc.pid) as rss:
                    r = median_run([asyncio.run(run_level(base, n, 64)) for _ in range(repeats)])
                peak = rss.peak_kib / 1024
                rows.append(
                    {"server": name, "streams": n, **{k: r[k] for k in ("tok_s", "ttft_p50", "itl_p50", "itl_p99")}}
                )
                print(f"| {name} | {n} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} | "
                      f"{r['itl_p50'] * 1000:.1f} / {r['itl_p99'] * 1000:.1f} | {idle:.0f} / {peak:.0f} |",
                      flush=True)  # fmt: skip
        finally:
            stop_server(proc)
    if out is not None:
        write_results(out, "serving", rows)


def settled_run(base: str) -> float:
    """One stream's tok/s, after a second of quiet: the other server's threads may still spin-wait after its run
    (torch's OpenMP workers, llama.cpp's pool) and would take a core from this one."""
    time.sleep(1.0)
    return asyncio.run(run_level(base, 1, 64))["tok_s"]


def alternate(rounds: int, llama_server: str) -> None:
    """One stream, this server (default flags) and llama.cpp's up side by side, measured in turn `rounds` times:
    a swing of the machine's memory bandwidth then moves both sides of each round alike."""
    smolserve, smol_base = start_server("--model", MODEL, "--log-level", "warning")
    llama, llama_base = start_llama(llama_server, 64)
    try:
        for base in (smol_base, llama_base):
            asyncio.run(run_level(base, 2, 8))  # warm-up
        ratios = []
        for index in range(rounds):
            ours, theirs = (settled_run(base) for base in (smol_base, llama_base))
            ratios.append(ours / theirs)
            print(f"round {index + 1}: smolserve {ours:.1f} tok/s, llama.cpp {theirs:.1f} ({ratios[-1]:.2f}x)")
        print(f"median ratio over {rounds} rounds: {statistics.median(ratios):.2f}x")
    finally:
        stop_server(smolserve)
        stop_server(llama)


def long_prompts(lengths: list[int], rounds: int, llama_server: str | None, out: Path | None = None) -> None:
    """Time to a one-token answer for prompts of ``lengths`` tokens on an idle server (prefill), both servers up
    and measured in turn. Every request is a new window of a text (its first token differs), so neither server's
    prefix cache holds any of it."""
    import pydoc_data.topics

    import httpx

    servers = {"smolserve": start_server("--model", MODEL, "--log-level", "warning")}
    if llama_server:
        servers["llama.cpp"] = start_llama(llama_server, 1, max(lengths) + 64)
    try:
        text = "\n\n".join(pydoc_data.topics.topics[name] for name in sorted(pydoc_data.topics.topics))
        needed = (rounds * sum(lengths) + 64) * len(servers)
        tokenize = {"model": MODEL, "prompt": text[: 6 * needed]}
        ids = httpx.post(servers["smolserve"][1] + "/tokenize", json=tokenize, timeout=120).json()["tokens"]
        assert len(ids) >= needed, "the text is too short for these prompts"
        offset = 0

        def answer_ms(base: str, length: int) -> float:
            nonlocal offset
            body = {"model": MODEL, "prompt": ids[offset : offset + length], "max_tokens": 1, "temperature": 0}
            offset += length
            time.sleep(0.5)  # the other server's threads settle
            start = time.perf_counter()
            response = httpx.post(base + "/v1/completions", json=body, timeout=600)
            assert response.status_code == 200, response.text
            return (time.perf_counter() - start) * 1000

        for _, base in servers.values():
            answer_ms(base, 64)  # warm-up
        rows: list[dict[str, Any]] = []
        print("| prompt tokens | " + " | ".join(f"{name} (ms)" for name in servers) + " |")
        print("|---" * (len(servers) + 1) + "|")
        for length in lengths:
            times: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(rounds):
                for name, (_, base) in servers.items():
                    times[name].append(answer_ms(base, length))
            print(f"| {length} | " + " | ".join(f"{statistics.median(t):.0f}" for t in times.values()) + " |",
                  flush=True)  # fmt: skip
            rows += [{"prompt_tokens": length, "server": name, "ms": statistics.median(t)} for name, t in times.items()]
        if out is not None:
            write_results(out, "long_prompts", rows)
    finally:
        for proc, _ in servers.values():
            stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ppl-tokens", type=int, default=16384)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--http", action="store_true", help="only: the servers over HTTP")
    parser.add_argument("--steps", action="store_true", help="only: decode step times")
    parser.add_argument("--alternate", type=int, default=0, help="only: N rounds of one stream, both servers in turn")
    parser.add_argument("--long-prompts", type=int, nargs="*", help="only: one-token answers to prompts this long")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server, to compare against")
    parser.add_argument("--json", type=Path, default=None, help="--http, --long-prompts: the rows as JSON (plot.py)")
    args = parser.parse_args()
    if args.http:
        http(args.concurrency, args.repeats, args.llama_server, args.json)
        return
    if args.alternate:
        alternate(args.alternate, args.llama_server)
        return
    if args.long_prompts:
        long_prompts(args.long_prompts, args.repeats, args.llama_server, args.json)
        return
    if not args.steps:
        quality(args.ppl_tokens)
    steps(args.batches)


if __name__ == "__main__":
    main()
