"""Charts of the benchmarks' JSON output, as PNGs beside ``bench/README.md`` (matplotlib: the ``bench`` extra).

    .venv/bin/python bench/plot.py bench/results/*.json --out bench/charts

Each file is one benchmark's run: ``bench_quantized.py --http --json`` (kind ``serving``: throughput and time to the
first token by concurrency, each server a line), ``bench_quantized.py --long-prompts ... --json`` (``long_prompts``:
time to a one-token answer by prompt length), ``bench_speculative.py --json`` (``speculative``: speed against no
drafts by prompt kind and streams) or ``bench_neighbour.py --json`` (throughput beside busy neighbours as
a ratio of quiet). Every chart names the date, commit and CPU of its run.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display
import matplotlib.pyplot as plt


def _caption(record: dict[str, Any]) -> str:
    return f"{record.get('date', '?')}, commit {record.get('commit', '?')}, {record.get('cpu', '?')}"


def serving(record: dict[str, Any], out: Path) -> list[Path]:
    by_server: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in record["rows"]:
        by_server[row["server"]].append(row)
    written = []
    for key, label, name in (("tok_s", "tokens per second", "throughput"), ("ttft_p50", "TTFT p50 (s)", "ttft")):
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for server, rows in by_server.items():
            rows.sort(key=lambda row: row["streams"])
            ax.plot([r["streams"] for r in rows], [r[key] for r in rows], marker="o", label=server)
        ax.set(xscale="log", xlabel="concurrent streams", ylabel=label, title=f"{label} by concurrency")
        ax.set_xticks(sorted({r["streams"] for r in record["rows"]}), labels=None)
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        written.append(_save(fig, ax, record, out / f"{name}.png"))
    return written


def long_prompts(record: dict[str, Any], out: Path) -> list[Path]:
    by_server: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for row in record["rows"]:
        by_server[row["server"]].append((row["prompt_tokens"], row["ms"] / 1000))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for server, points in by_server.items():
        points.sort()
        ax.plot([p for p, _ in points], [s for _, s in points], marker="o", label=server)
    ax.set(xlabel="prompt tokens", ylabel="time to a one-token answer (s)", title="Long prompts on an idle server")
    return [_save(fig, ax, record, out / "long_prompts.png")]


def neighbours(record: dict[str, Any], out: Path) -> list[Path]:
    """``bench_neighbour.py --json``: each server's throughput with 1 and 2 busy neighbours, as a ratio of quiet."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    bars = []  # (label, [ratio with k neighbours for k = 1, 2, ...])
    for server, runs in record["rows"].items():
        quiet = runs["0"]
        busy = sorted((k for k in runs if k != "0"), key=int)
        for streams in sorted(quiet, key=int):
            ratios = [runs[k][streams]["tok_s"] / quiet[streams]["tok_s"] for k in busy]
            bars.append((f"{server}, {streams} stream{'' if streams == '1' else 's'}", ratios))
    width = 0.8 / max(len(bars), 1)
    for index, (label, ratios) in enumerate(bars):
        ax.bar([k + index * width for k in range(len(ratios))], ratios, width=width, label=label)
    groups = max((len(ratios) for _, ratios in bars), default=0)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(groups)], [f"{k + 1} busy neighbour(s)" for k in range(groups)])
    ax.set(ylabel="throughput / quiet", title="Beside busy neighbours", ylim=(0, 1.05))
    return [_save(fig, ax, record, out / "neighbours.png")]


def speculative(record: dict[str, Any], out: Path) -> list[Path]:
    """``bench_speculative.py --json``: each configuration's tokens per second against its own server without
    drafts, by prompt kind and concurrency (a level whose server failed: no bar)."""
    levels = sorted({(row["kind"], row["streams"]) for row in record["rows"]}, key=lambda k: (k[0] != "grounded", k))
    servers = [name for name in dict.fromkeys(row["server"] for row in record["rows"]) if not name.endswith(" none")]
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.8 / max(len(servers), 1)
    for index, server in enumerate(servers):
        mine = [row for row in record["rows"] if row["server"] == server]
        ratio = {(row["kind"], row["streams"]): row.get("ratio", 0) for row in mine}
        ax.bar([k + index * width for k in range(len(levels))], [ratio.get(level, 0) for level in levels],
               width=width, label=server)  # fmt: skip
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks([k + 0.4 - width / 2 for k in range(len(levels))], [f"{kind}, {n}" for kind, n in levels])
    ax.set(ylabel="tokens per second / without drafts", title="Prompt-lookup speculative decoding by prompts, streams")
    return [_save(fig, ax, record, out / "speculative.png")]


def _save(fig: Any, ax: Any, record: dict[str, Any], path: Path) -> Path:
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, _caption(record), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


CHARTS = {"serving": serving, "long_prompts": long_prompts, "neighbours": neighbours, "speculative": speculative}


def plot(files: list[Path], out: Path) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    for file in files:
        record = json.loads(file.read_text())
        written += CHARTS[record["kind"]](record, out)
    return written


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "charts")
    args = parser.parse_args()
    for path in plot(args.files, args.out):
        print(path)


if __name__ == "__main__":
    main()
