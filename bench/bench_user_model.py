"""The model a user brings: a GGUF of their choice (by default the Qwen2.5-Coder-0.5B-Instruct Q4_K_M that
``../shared/tools/user-models.sh`` assembles) served by smolserve (from its blocks, default flags) and by llama.cpp's
``llama-server``, both up together and measured in turn at each level, ``--rounds`` times; the ratio of each round is
paired (same minutes of the machine) and the median reported.

    .venv/bin/python bench/bench_user_model.py --llama-server "$(../shared/tools/build-llama-server.sh)"
    .venv/bin/python bench/bench_user_model.py --gguf FILE --levels 1 8 32 --rounds 3 --long-prompt 2000

Throughput: closed-loop streaming completions, 64 greedy tokens each (ignore_eos), at each level. Long prompt: the
time to first token of a prompt of about ``--long-prompt`` tokens (fresh text each time: no prefix-cache hit), one
token answered, the median of 3 on each server. Also: the start-up time of smolserve and its resident memory.
``--smolserve-arg`` adds a flag to smolserve's defaults (``--smolserve-arg=--speculative --smolserve-arg=none``: one
stream without drafts, where a random-weight file's repeating text makes prompt lookup's drafts unusually good).

``--in-turn``: for a file too big for both servers at once (``bench/shaped_gguf.py``'s), each server alone, smolserve
first; each level's median of ``--rounds`` runs, the ratio of the two medians (unpaired), each one's start-up time
and resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import bench_serving  # noqa: E402
from bench_serving import RssSampler, run_level  # noqa: E402
from llama import start_llama  # noqa: E402

from compat.conftest import start_server, stop_server  # noqa: E402

USER_MODELS = ROOT.parent / "shared" / "tools" / "user-models.sh"


WORDS = [
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school", "state",
    "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week", "company", "system",
    "program", "question", "work", "government", "number", "night", "point", "home", "water", "room", "mother",
    "area", "money", "story", "fact", "month", "lot", "right", "study", "book", "eye", "job", "word", "business",
]  # fmt: skip


def long_prompt_ms(base: str, tokens: int, run: int) -> float:
    """Time to the one answered token of a fresh prompt of ~``tokens`` tokens (common words: about one each)."""
    words = f"Run {run}." + "".join(f" {WORDS[(i * 7 + run) % len(WORDS)]}" for i in range(tokens))
    body = {"model": bench_serving.MODEL, "prompt": words, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--levels", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--long-prompt", type=int, default=2000)
    parser.add_argument("--llama-context", type=int, default=4096, help="llama.cpp's positions per slot (a 16k prompt)")
    parser.add_argument(
        "--smolserve-arg",
        action="append",
        default=[],
        help="a flag for smolserve beyond the defaults, e.g. --smolserve-arg=--speculative --smolserve-arg=none",
    )
    parser.add_argument(
        "--in-turn",
        action="store_true",
        help="one server up at a time (a file too big for both): the ratio of medians, unpaired",
    )
    args = parser.parse_args()
    gguf = args.gguf or Path(subprocess.check_output(["bash", str(USER_MODELS)], text=True).strip())
    bench_serving.MODEL = gguf.stem
    if args.in_turn:
        return in_turn(gguf, args)
    started = time.perf_counter()
    ours, ours_base = start_server("--model", str(gguf), "--embedding-model", "none", *args.smolserve_arg)
    startup = time.perf_counter() - started
    slots = max(args.levels, default=1)
    llama, llama_base = start_llama(args.llama_server, slots, context=args.llama_context, gguf=gguf)
    servers = {"smolserve": ours_base, "llama.cpp": llama_base}
    try:
        rss = RssSampler(ours.pid).rss_kib() / 1024
        print(f"{gguf.name}: smolserve ready in {startup:.1f} s, RSS {rss:.0f} MiB")
        for base in servers.values():  # warm-up
            asyncio.run(run_level(base, 2, 8))
        rows = []
        for level in args.levels:
            runs: dict[str, list[float]] = {name: [] for name in servers}
            for _ in range(args.rounds):
                for name, base in servers.items():
                    runs[name].append(asyncio.run(run_level(base, level, args.new_tokens))["tok_s"])
            ratio = statistics.median(a / b for a, b in zip(runs["smolserve"], runs["llama.cpp"], strict=True))
            row = {"streams": level, **{n: statistics.median(v) for n, v in runs.items()}, "ratio": ratio}
            rows.append(row)
            print(json.dumps(row), flush=True)
        if args.long_prompt:
            ttft = {
                name: statistics.median(long_prompt_ms(base, args.long_prompt, 100 * i + j) for j in range(3))
                for i, (name, base) in enumerate(servers.items())
            }
            print(json.dumps({"long_prompt_tokens": args.long_prompt, "ttft_ms": ttft}), flush=True)
        table(rows)
    finally:
        stop_server(ours)
        stop_server(llama)


def in_turn(gguf: Path, args: argparse.Namespace) -> None:
    """Each server alone on the machine, smolserve first: its start-up and resident memory, then each level's
    median tokens/s of ``--rounds`` runs, and the long prompt's time to first token."""
    measured: dict[str, dict] = {}
    for name in ("smolserve", "llama.cpp"):
        started = time.perf_counter()
        if name == "smolserve":
            proc, base = start_server("--model", str(gguf), "--embedding-model", "none", *args.smolserve_arg)
        else:
            proc, base = start_llama(args.llama_server, max(args.levels, default=1), context=args.llama_context,
                                     gguf=gguf)  # fmt: skip
        ready = time.perf_counter() - started
        try:
            rss = RssSampler(proc.pid).rss_kib() / 1024
            asyncio.run(run_level(base, 2, 8))  # warm-up
            levels = {level: statistics.median(asyncio.run(run_level(base, level, args.new_tokens))["tok_s"]
                                               for _ in range(args.rounds)) for level in args.levels}  # fmt: skip
            prompts = range(3) if args.long_prompt else range(0)
            ttft = statistics.median([long_prompt_ms(base, args.long_prompt, j) for j in prompts] or [0.0])
            measured[name] = {"ready_s": round(ready, 1), "rss_mib": round(rss), "tok_s": levels, "ttft_ms": ttft}
            print(json.dumps({name: measured[name]}), flush=True)
        finally:
            stop_server(proc)
    ours, theirs = measured["smolserve"], measured["llama.cpp"]
    table([{"streams": level, "smolserve": ours["tok_s"][level], "llama.cpp": theirs["tok_s"][level],
            "ratio": ours["tok_s"][level] / theirs["tok_s"][level]} for level in args.levels])  # fmt: skip


def table(rows: list[dict]) -> None:
    print("\n| streams | smolserve tok/s | llama.cpp tok/s | ratio |\n|---|---|---|---|")
    for row in rows:
        print(f"| {row['streams']} | {row['smolserve']:.1f} | {row['llama.cpp']:.1f} | {row['ratio']:.2f}x |")


if __name__ == "__main__":
    main()
