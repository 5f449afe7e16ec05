"""Throughput beside busy neighbours: the machine quiet, then with one and two other processes each keeping a
core busy (`python3 -c "while True: pass"`: a compile, a browser tab, another container), at 1 and 8 streams;
this server, variants of it, and llama.cpp's `llama-server` on the same GGUF when given its path.

    .venv/bin/python bench/bench_neighbour.py
    .venv/bin/python bench/bench_neighbour.py --llama-server "$(../shared/tools/build-llama-server.sh)"
    .venv/bin/python bench/bench_neighbour.py --variant pinned -- --threads 2   # the team kept whole
    .venv/bin/python bench/bench_neighbour.py --env OMP_WAIT_POLICY=passive     # a wait policy, by environment
    .venv/bin/python bench/bench_neighbour.py --ab-tree ../before               # another checkout beside this one

Each server runs alone on the machine in turn. For each neighbour count, the neighbours start, a 2-second
burst of streams lets the server settle (this server's thread governor decides over 1 s of stepping; llama.cpp
gets the same burst), then each level runs `--repeats` times (the median run is kept): closed-loop streaming
clients, greedy, `--new-tokens` each. Prints a table (tokens per second, the ratio to quiet, inter-token
latency p50/p99) and writes every run to `--json` for `bench/README.md`.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_serving import median_run, run_level  # noqa: E402
from llama import start_llama  # noqa: E402
from record import write_results  # noqa: E402

from compat.conftest import MODEL, start_server, stop_server  # noqa: E402

HOG = "while True: pass"


def settle(base: str, seconds: float = 2.0) -> None:
    """Streams for about ``seconds``: the server steps, and adapts to what else runs."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        asyncio.run(run_level(base, 2, 16))


def measure(base: str, levels: list[int], new_tokens: int, repeats: int, neighbours: int) -> dict[int, dict]:
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(neighbours)]
    try:
        settle(base)
        return {n: median_run([asyncio.run(run_level(base, n, new_tokens)) for _ in range(repeats)]) for n in levels}
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def targets(args: argparse.Namespace) -> list[tuple[str, object]]:
    name = args.variant or ("this tree" + (f" {' '.join(args.server_args)}" if args.server_args else ""))
    env = dict(item.split("=", 1) for item in args.env)
    found: list[tuple[str, object]] = [(name, (args.server_args, env, ROOT))]
    if args.ab_tree is not None:
        found.append((str(args.ab_tree), (args.server_args, env, args.ab_tree.resolve())))
    if args.llama_server:
        found.append(("llama.cpp", args.llama_server))
    return found


def run_target(spec: object, args: argparse.Namespace) -> dict[int, dict[int, dict]]:
    if isinstance(spec, str):
        proc, base = start_llama(spec, max(args.concurrency))
    else:
        flags, env, root = spec  # type: ignore[misc]
        proc, base = start_server("--model", MODEL, "--log-level", "warning", *flags, root=root, env=env)
    try:
        asyncio.run(run_level(base, 2, 8))  # warm-up
        return {k: measure(base, args.concurrency, args.new_tokens, args.repeats, k) for k in args.neighbours}
    finally:
        stop_server(proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--neighbours", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--llama-server", default=None, help="path of llama.cpp's llama-server, to compare against")
    parser.add_argument("--ab-tree", type=Path, default=None, help="another checkout to serve and measure too")
    parser.add_argument("--variant", default=None, help="a name for this tree's row")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="for this tree's server")
    parser.add_argument("--json", type=Path, default=Path("/tmp/bench_neighbour.json"))
    parser.add_argument("server_args", nargs="*", help="flags for python -m app (after --)")
    args = parser.parse_args()
    results = {name: run_target(spec, args) for name, spec in targets(args)}
    write_results(args.json, "neighbours", results)
    columns = [f"{k} busy neighbour{'s' if k > 1 else ''}" if k else "quiet tok/s" for k in args.neighbours]
    print(f"| server | streams | {' | '.join(columns)} | ITL p50 / p99 (ms), in the same order |")
    print("|---|---|" + "---|" * (len(columns) + 1))
    for name, by_neighbours in results.items():
        for n in args.concurrency:
            runs = [by_neighbours[k][n] for k in args.neighbours]
            quiet = runs[0]["tok_s"]
            cells = [f"{quiet:.1f}"] + [f"{r['tok_s']:.1f} ({r['tok_s'] / quiet:.2f}x)" for r in runs[1:]]
            itl = ", ".join(f"{r['itl_p50'] * 1e3:.1f} / {r['itl_p99'] * 1e3:.1f}" for r in runs)
            print(f"| {name} | {n} | {' | '.join(cells)} | {itl} |")


if __name__ == "__main__":
    main()
