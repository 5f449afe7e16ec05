"""What a decode step of a GGUF served from its blocks is made of: the engine in process (default flags' path:
the blocks, batch invariance, the machine's thread team), ``--rows`` sequences decoding, torch's profiler over
``--steps`` steps; prints the step's median wall time, the bytes of blocks a token reads and the bandwidth that
makes, and the time by op (self CPU time, every thread's, over the steps' wall time).

    .venv/bin/python bench/shaped_gguf.py qwen2.5-7b --out /tmp/qwen2.5-7b-shaped.gguf
    .venv/bin/python bench/profile_step.py --gguf /tmp/qwen2.5-7b-shaped.gguf --rows 1 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--rows", type=int, nargs="*", default=[1])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()
    import torch

    from engine import chooser
    from engine.core.config import EngineConfig
    from engine.core.types import GenerationRequest

    config = EngineConfig(model=str(args.gguf), embedding_model="none", speculative="none",
                          max_batch_size=max(max(args.rows), 8), kv_disk_dir=None)  # fmt: skip
    # Built and stepped on this thread (the profiler records the ops of the thread that starts it).
    engine = chooser.build(config, ThreadPoolExecutor(max_workers=1)).engine
    blocks = read_a_token(args.gguf)
    for rows in args.rows:
        engine.admit([GenerationRequest(tuple(range(100 + i, 164 + i)), 3 * args.steps + 16, ignore_eos=True)
                      for i in range(rows)])  # fmt: skip
        for _ in range(-(-rows * 64 // config.max_num_batched_tokens) + 3):  # the prompts, then warm decode steps
            engine.step()
        walls = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            for _ in range(args.steps):
                began = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - began)
        step = statistics.median(walls)
        print(f"\n{rows} rows: step {step * 1e3:.1f} ms, {blocks / 1e9:.2f} GB of blocks a step, "
              f"{blocks / step / 1e9:.1f} GB/s", flush=True)  # fmt: skip
        total = sum(walls)
        events = sorted(profile.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
        for event in events[: args.top]:
            share = event.self_cpu_time_total / 1e6 / total
            print(f"  {event.key:<40} {event.count // args.steps:>6} a step  {share * 100:5.1f}% of the wall time")
        engine.reset()
    engine.close()


def read_a_token(gguf: Path) -> int:
    """The bytes of blocks a token reads: every matrix's but the embedding's (a row a token), as the file holds
    them (the packed blocks are the file's size); a tied embedding is read whole as the output layer."""
    from engine.runtime.gguf_file import GGUFFile

    tensors = GGUFFile(gguf).tensors
    tied = not any(t.name == "output.weight" for t in tensors)
    return sum(t.data.nbytes for t in tensors if len(t.shape) > 1 and (tied or t.name != "token_embd.weight"))


if __name__ == "__main__":
    main()
