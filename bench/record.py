"""A benchmark run's rows as JSON, for ``bench/plot.py``: with the date, commit and CPU they were measured on."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def write_results(out: Path, kind: str, rows: Any) -> None:
    """The run's rows as JSON for ``bench/plot.py``, with the date, commit and CPU they were measured on."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")  # fmt: skip
    record = {
        "kind": kind,
        "date": time.strftime("%Y-%m-%d"),
        "commit": commit.stdout.strip(),
        "cpu": cpu,
        "rows": rows,
    }
    out.write_text(json.dumps(record, indent=1) + "\n")
