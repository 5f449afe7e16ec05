"""The native attention kernel on a prompt chunk at long contexts: one layer's call for ``--rows`` consecutive
prompt rows of one sequence (a prefill chunk, as the planner cuts them) at contexts ``--contexts``, over a block
cache whose blocks are shuffled, in the model's shape (default Qwen2.5-Coder-0.5B's: 2 KV heads of 64 dims, 7 query
heads each), float32 or (``--dtype bfloat16``, as `--dtype auto` serves on CPUs with BF16) bfloat16. Best of 7
calls; GFLOP/s counts the two products (scores and values).

    .venv/bin/python bench/bench_attention.py
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.runtime import kernels


def measure(
    context: int, rows: int, kv_heads: int, groups: int, dim: int, block: int = 16, dtype: torch.dtype = torch.float32
) -> float:
    attend = kernels.decode_attention()
    assert attend is not None, "the native kernels did not build"
    torch.manual_seed(0)
    blocks = -(-context // block)
    keys, values = (torch.randn(kv_heads, 2 * blocks * block, dim, dtype=dtype) for _ in range(2))
    tables = torch.randperm(2 * blocks)[:blocks].int().expand(rows, blocks).contiguous()
    lengths = torch.arange(context - rows + 1, context + 1)
    query = torch.randn(rows, kv_heads, groups, dim, dtype=dtype)
    times = []
    for _ in range(9):
        started = time.perf_counter()
        attend(query, keys, values, tables, lengths, block, dim**-0.5, 0, None)
        times.append(time.perf_counter() - started)
    return min(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--shape", type=int, nargs=3, default=[2, 7, 64], metavar=("KV_HEADS", "GROUPS", "DIM"))
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    kv_heads, groups, dim = args.shape
    print(f"{'context':>8} {'ms a layer':>11} {'GFLOP/s':>8}")
    for context in args.contexts:
        seconds = measure(context, args.rows, kv_heads, groups, dim, dtype=dtype)
        flops = 4 * args.rows * kv_heads * groups * context * dim
        print(f"{context:>8} {seconds * 1000:>11.1f} {flops / seconds / 1e9:>8.1f}")


if __name__ == "__main__":
    main()
