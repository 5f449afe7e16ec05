"""Prompt-lookup speculative decoding: ``--speculative ngram`` and ``auto`` against ``none``, and llama.cpp's n-gram
speculation against its plain decoding, on grounded and free chat prompts.

    .venv/bin/python bench/bench_speculative.py [--llama PATH] [--streams 1 8 32] [--tokens 128] [--rounds 3]
        [--llama-rounds 1] [--json OUT]

Grounded prompts: repeat, fix the grammar of, summarize, or extract from a paragraph of 60-200 words; free prompts:
stories. Greedy, ``max_tokens`` 128 (a sequence may end earlier at its EOS). A family's servers (smolserve's
three configurations, then llama.cpp's four) are all up at once, idle but for the one measured; at each prompt
kind and stream count they are measured in turn, ``--rounds`` times round (the machine's speed swings by a fifth
within minutes: alternating keeps each ratio side by side), and each configuration's median is reported. A
measurement: N clients send the kind's prompts round-robin, non-streaming, ``2 * max(N, 8)`` requests in all
after a warm-up; output tokens per second over the run. For
smolserve, the acceptance rate (accepted / drafted tokens) and the mean tokens accepted per draft come from its
``/metrics`` counters; for llama.cpp, from each response's ``timings`` (``draft_n``, ``draft_n_accepted``). The
last column checks that greedy outputs with drafts are those without (the same text for the same prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.llama import start_llama  # noqa: E402
from bench.record import write_results  # noqa: E402
from compat.conftest import MODEL, start_server, stop_server  # noqa: E402

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for nearly two hundred years. Sailors trusted its light on "
    "stormy nights, and the keeper's family lived in the small stone house beside it, tending the lamp, painting "
    "the railings and writing down every ship that passed in a thick leather book. When the light was automated in "
    "1987, the last keeper, Margaret Hale, moved to the village below, but she still climbed the path every Sunday.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose and "
    "oxygen. It happens mostly in the leaves, inside chloroplasts, which hold the green pigment chlorophyll. The "
    "light-dependent reactions split water and store energy in ATP and NADPH; the Calvin cycle then uses that "
    "energy to fix carbon dioxide into sugars that the plant can burn or store as starch.",
    "our team meet on monday to discussed the budget for the new warehouse, but nobody have brought the numbers, so "
    "we decide to meeting again next week when everyone has did their homework. the manager say that the report "
    "are due on friday and that any person who miss the deadline will has to explain theirself to the director.",
    "Order #4471 was placed on March 3 by Daniel Okafor of Leeds for three items: a walnut desk (249 pounds), two "
    "brass lamps (38 pounds each) and a wool rug (120 pounds). Delivery was booked for March 10 with Northway "
    "Freight, reference NW-88213. The customer asked for the desk to be left in the garage and paid by card ending "
    "in 5521; a refund of 38 pounds was issued on March 12 because one lamp arrived with a cracked shade.",
    "Rust's ownership model gives every value a single owner, and the value is dropped when its owner goes out of "
    "scope. References borrow a value without taking ownership: any number of shared references, or exactly one "
    "mutable reference, may exist at a time, and the borrow checker enforces these rules at compile time. This "
    "prevents data races and use-after-free errors without a garbage collector, at the cost of a steeper learning "
    "curve for programmers who come from languages where aliasing is unrestricted.",
    "The village market opens at seven every Saturday. Farmers bring eggs, cheese, apples and bread from the "
    "valley, and a man named Tomas sells honey from forty hives he keeps on the hill above the church. By noon "
    "the square is full of families, dogs and musicians, and the cafe on the corner runs out of croissants.",
]
TASKS = [
    "Repeat this paragraph exactly:",
    "Fix the grammar of this paragraph and give the corrected text:",
    "Summarize this paragraph in a few sentences:",
    "Extract every name, date and number from this paragraph, one per line, each with its context:",
]
STORIES = [
    "a dragon who is afraid of the dark",
    "a robot that learns to bake bread",
    "two friends lost in a snowstorm",
    "a cat who becomes mayor of a small town",
    "an astronaut who finds a garden on the moon",
    "a violin that plays by itself at midnight",
]


def prompts(kind: str) -> list[str]:
    if kind == "grounded":
        return [f"{task}\n\n{paragraph}" for paragraph in PARAGRAPHS for task in TASKS]
    return [f"Write a short story about {topic}." for topic in STORIES]


async def ask(client: httpx.AsyncClient, base: str, text: str, tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0}  # fmt: skip
    response = await client.post(f"{base}/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    return response.json()


async def level(base: str, kind: str, streams: int, tokens: int) -> tuple[float, dict[str, str], list[int]]:
    """Output tokens per second with ``streams`` clients; each prompt's text; llama.cpp's draft counts."""
    texts = prompts(kind)
    total = max(2 * max(streams, 8), len(texts)) if streams == 1 else 2 * max(streams, 8)
    queue = list(range(total))
    answers: dict[str, str] = {}
    drafted = [0, 0]
    generated = 0

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal generated
        while queue:
            text = texts[queue.pop() % len(texts)]
            answer = await ask(client, base, text, tokens)
            generated += answer["usage"]["completion_tokens"]
            answers[text] = answer["choices"][0]["message"]["content"]
            timings = answer.get("timings", {})
            drafted[0] += timings.get("draft_n", 0)
            drafted[1] += timings.get("draft_n_accepted", 0)

    async with httpx.AsyncClient() as client:
        await ask(client, base, texts[0], 8)  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
        elapsed = time.perf_counter() - started
    return generated / elapsed, answers, drafted


def counters(base: str) -> dict[str, float]:
    """smolserve's speculative counters."""
    values = {}
    for line in httpx.get(f"{base}/metrics").text.splitlines():
        if line.startswith("smolserve:spec_decode_num_") and "_created" not in line:
            name, value = line.split()
            values[name.removeprefix("smolserve:spec_decode_num_").removesuffix("_total")] = float(value)
    return values


def servers(llama: str | None) -> list[tuple[str, list[str] | None]]:
    """Each configuration: smolserve's flags, or (None) llama.cpp's extra flags as the name says."""
    mine = [("smolserve none", ["--speculative", "none"]), ("smolserve ngram", ["--speculative", "ngram"]),
            ("smolserve auto", ["--speculative", "auto"])]  # fmt: skip
    if not llama:
        return mine
    return [*mine, ("llama.cpp none", None), ("llama.cpp ngram-simple", None), ("llama.cpp ngram-simple n3 m8", None),
            ("llama.cpp ngram-mod", None)]  # fmt: skip


LLAMA_FLAGS = {
    "llama.cpp none": [],
    "llama.cpp ngram-simple": ["--spec-type", "ngram-simple"],
    "llama.cpp ngram-simple n3 m8": ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
                                     "--spec-ngram-simple-size-m", "8"],
    "llama.cpp ngram-mod": ["--spec-type", "ngram-mod"],
}  # fmt: skip


def start(name: str, flags: list[str] | None, llama: str | None, slots: int) -> tuple[Any, str]:
    if flags is not None:
        return start_server("--model", MODEL, *flags)
    assert llama is not None
    return start_llama(llama, slots, context=1024, extra=LLAMA_FLAGS[name])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama", help="llama-server binary (../shared/tools/build-llama-server.sh prints it)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--kinds", nargs="+", default=["grounded", "free"])
    parser.add_argument("--rounds", type=int, default=3, help="measurements of each smolserve level (median)")
    parser.add_argument("--llama-rounds", type=int, default=1, help="... of each llama.cpp level")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    reference: dict[str, str] = {}
    print("| server | prompts | streams | tok/s | vs none | acceptance | accepted per draft | same text |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    configs = servers(args.llama)
    for family, rounds in (("smolserve", args.rounds), ("llama.cpp", args.llama_rounds)):
        mine = [(name, flags) for name, flags in configs if name.startswith(family)]
        try:
            for kind in args.kinds:
                for streams in args.streams:
                    rows += measure_level(mine, rounds, args, kind, streams, reference)
                    if args.json:  # after every level: a server that dies later leaves what was measured
                        write_results(args.json, "speculative", rows)
        finally:
            for name, _ in mine:
                stop(name)


SERVING: dict[str, tuple[Any, str]] = {}  # the servers up, by their configuration's name


def measure_level(configs: list[tuple[str, list[str] | None]], rounds: int, args: argparse.Namespace, kind: str,
                  streams: int, reference: dict[str, str]) -> list[dict[str, Any]]:  # fmt: skip
    """Each configuration at one prompt kind and stream count, ``rounds`` times in turn; the median of each, its
    acceptance over all rounds; rows in ``configs``' order (the first, without drafts, is the others' base)."""
    samples: dict[str, list[tuple[float, dict[str, str], list[float]]]] = {name: [] for name, _ in configs}
    for _ in range(rounds):
        for name, flags in configs:
            if (sample := measure(name, flags, args, kind, streams)) is not None:
                samples[name].append(sample)
    rows = []
    for name, _ in configs:
        if not samples[name]:
            print(f"| {name} | {kind} | {streams} | failed | | | | |", flush=True)
            rows.append({"server": name, "kind": kind, "streams": streams, "failed": True})
            continue
        row = summarize(name, kind, streams, samples[name], rows)
        if name == "smolserve none" and streams == 1:
            reference.update(samples[name][0][1])
        elif name.startswith("smolserve") and streams == 1:
            answers = samples[name][0][1]
            row["same_text"] = f"{sum(reference.get(k) == v for k, v in answers.items())}/{len(answers)}"
        rows.append(row)
        rate = "-" if row["acceptance"] is None else f"{row['acceptance']:.0%}"
        print(f"| {name} | {kind} | {streams} | {row['tok_s']:.1f} | {row['ratio']:.2f}x | {rate} | "
              f"{row['accepted_per_draft'] or '-'} | {row['same_text']} |", flush=True)  # fmt: skip
    return rows


def summarize(name: str, kind: str, streams: int, samples: list[tuple[float, dict[str, str], list[float]]],
              rows: list[dict[str, Any]]) -> dict[str, Any]:  # fmt: skip
    """The median rate of the samples, against the level's configuration without drafts (the first of ``rows``);
    the acceptance rate and accepted tokens per draft over all of them (None where nothing was drafted)."""
    rates = sorted(rate for rate, _, _ in samples)
    rate = rates[len(rates) // 2]
    drafted, accepted, drafts = (sum(counts[i] for _, _, counts in samples) for i in range(3))
    base = next((r["tok_s"] for r in rows if r["server"].endswith(" none") and "tok_s" in r), rate)
    return {"server": name, "kind": kind, "streams": streams, "tok_s": round(rate, 1), "runs": rates,
            "ratio": round(rate / base, 3), "acceptance": round(accepted / drafted, 3) if drafted else None,
            "accepted_per_draft": round(accepted / drafts, 2) if drafts else None, "same_text": ""}  # fmt: skip


def measure(name: str, flags: list[str] | None, args: argparse.Namespace, kind: str,
            streams: int) -> tuple[float, dict[str, str], list[float]] | None:  # fmt: skip
    """Tokens per second, each prompt's text and (drafted, accepted, drafts) of one measurement; None where the
    server failed (llama.cpp's has crashed under n-gram drafts): it is started afresh for the next."""
    if name not in SERVING:
        SERVING[name] = start(name, flags, args.llama, max(args.streams))
    base = SERVING[name][1]
    try:
        before = counters(base) if flags is not None else {}
        rate, answers, llama_drafts = asyncio.run(level(base, kind, streams, args.tokens))
        after = counters(base) if flags is not None else {}
    except httpx.HTTPError as exc:
        print(f"{name} failed at {kind}, {streams} streams: {exc!r}", file=sys.stderr, flush=True)
        stop(name)
        return None
    if flags is None:
        return rate, answers, [llama_drafts[0], llama_drafts[1], 0]
    return rate, answers, [after[key] - before[key] for key in ("draft_tokens", "accepted_tokens", "drafts")]


def stop(name: str) -> None:
    if name in SERVING:
        stop_server(SERVING.pop(name)[0])


if __name__ == "__main__":
    main()
