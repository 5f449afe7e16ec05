"""Prompt-lookup speculative decoding: ``--speculative ngram`` and ``auto`` against ``none``, and llama.cpp's n-gram
speculation against its plain decoding, on grounded and free chat prompts.

    .venv/bin/python bench/bench_speculative.py [--llama PATH] [--streams 1 8 32] [--tokens 128] [--json OUT]

Grounded prompts: repeat, fix the grammar of, summarize, or extract from a paragraph of 60-200 words; free prompts:
stories. Greedy, ``max_tokens`` 128 (a sequence may end earlier at its EOS). Each server in turn (one at a time:
the machine has two cores), each prompt kind at each stream count: N clients send the kind's prompts round-robin,
non-streaming, ``2 * max(N, 8)`` requests in all after a warm-up; output tokens per second over the run. For
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


def acceptance(before: dict[str, float], after: dict[str, float], llama: list[int]) -> tuple[float, float]:
    """(accepted / drafted tokens, accepted tokens per draft); NaN where nothing was drafted."""
    if llama != [0, 0] or not after:
        drafted, accepted, drafts = llama[0], llama[1], float("nan")
    else:
        drafted = after["draft_tokens"] - before["draft_tokens"]
        accepted = after["accepted_tokens"] - before["accepted_tokens"]
        drafts = after["drafts"] - before["drafts"]
    rate = accepted / drafted if drafted else float("nan")
    return rate, (accepted / drafts if drafts else float("nan"))


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
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    reference: dict[str, str] = {}
    print("| server | prompts | streams | tok/s | vs none | acceptance | accepted per draft | same text |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    for name, flags in servers(args.llama):
        for kind in args.kinds:
            for streams in args.streams:
                rows.append(measure(name, flags, args, kind, streams, rows, reference))
                if args.json:  # after every row: a server that dies later leaves what was measured
                    write_results(args.json, "speculative", rows)
        stop(name)


SERVING: dict[str, tuple[Any, str]] = {}  # the server now up, by its configuration's name


def measure(name: str, flags: list[str] | None, args: argparse.Namespace, kind: str, streams: int,
            rows: list[dict[str, Any]], reference: dict[str, str]) -> dict[str, Any]:  # fmt: skip
    """One configuration at one prompt kind and stream count (its server started when not up); a server that
    fails (llama.cpp's has crashed under n-gram drafts) gives a row that says so, and is started afresh next."""
    if name not in SERVING:
        SERVING[name] = start(name, flags, args.llama, max(args.streams))
    base = SERVING[name][1]
    try:
        before = counters(base) if flags is not None else {}
        rate, answers, llama_drafts = asyncio.run(level(base, kind, streams, args.tokens))
        after = counters(base) if flags is not None else {}
    except httpx.HTTPError as exc:
        stop(name)
        print(f"| {name} | {kind} | {streams} | failed: {exc!r} | | | | |", flush=True)
        return {"server": name, "kind": kind, "streams": streams, "failed": repr(exc)}
    accepted, per_draft = acceptance(before, after, llama_drafts)
    family = name.split()[0]
    base_rate = next((r["tok_s"] for r in rows if r["server"] == f"{family} none" and r["kind"] == kind
                      and r["streams"] == streams and "tok_s" in r), rate)  # fmt: skip
    same = ""
    if name == "smolserve none" and streams == 1:
        reference.update(answers)
    elif family == "smolserve" and streams == 1:
        same = f"{sum(reference.get(k) == v for k, v in answers.items())}/{len(answers)}"
    print(f"| {name} | {kind} | {streams} | {rate:.1f} | {rate / base_rate:.2f}x | {accepted:.0%} | {per_draft:.2f} | "
          f"{same} |", flush=True)  # fmt: skip
    return {"server": name, "kind": kind, "streams": streams, "tok_s": round(rate, 1),
            "ratio": round(rate / base_rate, 3), "acceptance": round(accepted, 3),
            "accepted_per_draft": round(per_draft, 2), "same_text": same}  # fmt: skip


def stop(name: str) -> None:
    if name in SERVING:
        stop_server(SERVING.pop(name)[0])


if __name__ == "__main__":
    main()
