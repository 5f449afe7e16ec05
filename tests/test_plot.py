"""bench/plot.py turns each benchmark's JSON into its charts (PNG files)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from plot import plot

META = {"date": "2026-12-04", "commit": "abc1234", "cpu": "a CPU"}
RUN = {"tok_s": 100.0, "ttft_p50": 0.1, "itl_p50": 0.01, "itl_p99": 0.02}


def test_each_kind_of_run_becomes_its_charts(tmp_path: Path) -> None:
    serving = {**META, "kind": "serving", "rows": [
        {"server": server, "streams": n, **RUN, "tok_s": 10.0 * n} for server in ("a", "b") for n in (1, 8, 32)
    ]}  # fmt: skip
    prompts = {**META, "kind": "long_prompts", "rows": [
        {"server": "a", "prompt_tokens": n, "ms": n / 2} for n in (256, 1024, 4096)
    ]}  # fmt: skip
    busy = {**META, "kind": "neighbours", "rows": {
        "a": {str(k): {"1": {**RUN, "tok_s": 100.0 / (k + 1)}, "8": RUN} for k in range(3)}
    }}  # fmt: skip
    drafts = {**META, "kind": "speculative", "rows": [
        {"server": server, "kind": kind, "streams": n, "tok_s": 100.0, "ratio": 1.0 + ("auto" in server) / n}
        for server in ("s none", "s auto", "l none", "l ngram") for kind in ("grounded", "free") for n in (1, 8)
    ]}  # fmt: skip
    files = []
    for name, record in (("serving", serving), ("prompts", prompts), ("busy", busy), ("drafts", drafts)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(record))
        files.append(path)
    written = plot(files, tmp_path / "charts")
    assert sorted(p.name for p in written) == [
        "long_prompts.png",
        "neighbours.png",
        "speculative.png",
        "throughput.png",
        "ttft.png",
    ]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000
