"""The cost of the Ray Serve path: the one-process server against ``--replicas 1`` on a local Ray instance.

    .venv/bin/python bench/bench_cluster.py                     # 1 and 32 streams, 64 tokens, 3 rounds
    .venv/bin/python bench/bench_cluster.py --concurrency 1 8 32 --rounds 5

Each round starts each server in turn (never both up: Ray's own processes would tax the other side), warms it,
and measures every concurrency level as ``bench_serving.py`` does (closed-loop streaming clients, greedy,
``ignore_eos``); each side reports its median round. The issue's bounds: throughput >= 90% of the one process's,
TTFT p50 within +50 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.bench_serving import MODEL, measure_level, median_run, run_level  # noqa: E402
from compat.conftest import start_server, stop_server  # noqa: E402

SIDES = {"one process": [], "Ray, 1 replica": ["--replicas", "1"]}


def measure(side: list[str], levels: list[int], new_tokens: int) -> dict[int, dict[str, float]]:
    proc, base = start_server("--model", MODEL, "--max-batch-size", str(max(levels)), "--log-level", "warning", *side)
    try:
        asyncio.run(run_level(base, 2, 8))  # warm-up
        results = {}
        for n in levels:
            asyncio.run(run_level(base, n, 8))  # a short burst first, as bench_serving does
            results[n] = measure_level(proc.pid, base, n, new_tokens)
        return results
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs: dict[str, dict[int, list[dict[str, float]]]] = {s: {n: [] for n in args.concurrency} for s in SIDES}
    for round_ in range(args.rounds):
        for name, flags in SIDES.items():
            print(f"round {round_ + 1}: {name}", flush=True)
            for n, result in measure(flags, args.concurrency, args.new_tokens).items():
                runs[name][n].append(result)
    print("| streams | side | tok/s | TTFT p50 (ms) | ITL p50 (ms) | mean step (ms) |")
    print("|---|---|---|---|---|---|")
    for n in args.concurrency:
        medians = {name: median_run(runs[name][n]) for name in SIDES}
        for name, r in medians.items():
            print(
                f"| {n} | {name} | {r['tok_s']:.1f} | {r['ttft_p50'] * 1000:.0f} | {r['itl_p50'] * 1000:.1f} | "
                f"{r['step_ms']:.1f} |"
            )
        one, ray = medians["one process"], medians["Ray, 1 replica"]
        print(
            f"| {n} | Ray / one process | {ray['tok_s'] / one['tok_s']:.3f}x | "
            f"{(ray['ttft_p50'] - one['ttft_p50']) * 1000:+.0f} | | |"
        )


if __name__ == "__main__":
    main()
