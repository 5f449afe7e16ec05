"""A hybrid model's prefix after a restart: the prefix cache's disk tier keeps the recurrent state at a prompt's last
block end beside its KV blocks (``engine/runtime/kv_disk.py``, ``RecurrentStates``), so an engine started afresh
on the same folder resumes there instead of prefilling the prompt again.

The engine in process (default flags' path, the file's own blocks), one ``--tokens``-token prompt: **cold** (from
nothing; its blocks and state written), **restart** (a new engine over the same folder, the prompt and 50 tokens
more), **no disk** (the same, started without the tier). Seconds to the first token, and the prompt tokens the
cache gave.

    .venv/bin/python bench/shaped_gguf.py granite-4.0-h-1b --out /tmp/granite-shaped.gguf
    .venv/bin/python bench/bench_hybrid_restart.py --gguf /tmp/granite-shaped.gguf --tokens 4000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def first_token(gguf: Path, folder: str | None, prompt: tuple[int, ...]) -> tuple[float, int]:
    """Seconds to a fresh engine's first token of ``prompt`` (its disk tier in ``folder``; None: none), and the
    prompt tokens its prefix cache gave."""
    from engine import chooser
    from engine.core.config import EngineConfig
    from engine.core.types import GenerationRequest

    config = EngineConfig(model=str(gguf), embedding_model="none", max_batch_size=8, kv_disk_dir=folder,
                          kv_disk_gib=8.0 if folder else 0.0)  # fmt: skip
    engine = chooser.build(config, ThreadPoolExecutor(max_workers=1)).engine
    engine.admit([GenerationRequest(prompt, 4, ignore_eos=True)])  # (more than one token: its state is kept)
    began, outputs = time.perf_counter(), []
    while not outputs:
        outputs = engine.step()
    seconds = time.perf_counter() - began
    while engine.num_active():
        engine.step()
    engine.close()  # (its writers finish)
    return seconds, outputs[0].cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4000)
    args = parser.parse_args()
    prompt = tuple((i * 7919) % 100000 + 100 for i in range(args.tokens))
    later = prompt + tuple(range(200, 250))
    with tempfile.TemporaryDirectory() as folder:
        rows = [("cold", first_token(args.gguf, folder, prompt)), ("restart", first_token(args.gguf, folder, later)),
                ("no disk", first_token(args.gguf, None, later))]  # fmt: skip
    cold = rows[0][1][0]
    print(f"{'turn':<10} {'seconds':>8} {'x cold':>7} {'cached tokens':>14}")
    for name, (seconds, cached) in rows:
        print(f"{name:<10} {seconds:8.2f} {seconds / cold:7.3f} {cached:14d}")


if __name__ == "__main__":
    main()
