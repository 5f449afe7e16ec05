"""This tree's quantized matmul (``csrc/quant_matmul.cpp``) against another checkout's, in one process: the other's
source built under its own op namespace, both fed the same random blocks of each type, calls alternated.

    .venv/bin/python bench/bench_quant_kernel.py --against ../before --types Q4_K Q6_K Q5_K

Each matrix shape is repeated over enough copies (~200 MB) that one-row calls read from memory, not cache, as a
big model's decode step does. Prints, for each type, shape and row count, the median over 5 rounds of this tree's
time over the other's, and the packed bytes of each (the results are checked bitwise equal first).
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

SHAPES = [(896, 4864), (2048, 6144), (768, 2048)]  # [out, in]: Qwen2.5-0.5B's down, a 30B-A3B's q, its expert


def other_ops(tree: Path) -> object:
    """The other checkout's quant ops, as ``torch.ops.smolother``."""
    from torch.utils.cpp_extension import load

    from engine.runtime.kernels import _FLAGS

    source = (tree / "engine" / "runtime" / "csrc" / "quant_matmul.cpp").read_text()
    folder = Path(tempfile.mkdtemp(prefix="smolother-"))
    for header in (tree / "engine" / "runtime" / "csrc").glob("*.h"):
        (folder / header.name).write_text(header.read_text())
    source = re.sub(r"TORCH_LIBRARY_FRAGMENT\(smolserve", "TORCH_LIBRARY(smolother", source)
    source = re.sub(r"TORCH_LIBRARY_IMPL\(smolserve", "TORCH_LIBRARY_IMPL(smolother", source)
    (folder / "quant_matmul.cpp").write_text(source)
    load(name="smolother_quant", sources=[str(folder / "quant_matmul.cpp")], extra_cflags=_FLAGS,
         is_python_module=False)  # fmt: skip
    return torch.ops.smolother


def ratio(ours: object, theirs: object, packs: tuple[list, list], qtype: int, out: int, x: torch.Tensor) -> list[float]:
    mine, other = packs
    ratios = []
    for _ in range(5):
        began = time.perf_counter()
        for packed in other:
            theirs.quant_linear(x, packed, qtype, out, 0)
        middle = time.perf_counter()
        for packed in mine:
            ours.quant_linear(x, packed, qtype, out, 0)
        ratios.append((time.perf_counter() - middle) / (middle - began))
    return sorted(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", type=Path, required=True, help="the other checkout")
    parser.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "Q5_K"])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="the activations'")
    args = parser.parse_args()
    from gguf import GGML_QUANT_SIZES
    from test_quant_types import T, random_blocks

    from engine.runtime import kernels

    ours, theirs = kernels.native_ops(), other_ops(args.against)
    for name in args.types:
        qtype = int(T[name])
        for out, inp in SHAPES:
            copies = max(1, int(200e6 // (out * inp * 0.8)))
            block = GGML_QUANT_SIZES[T[name]][0]
            raws = [torch.from_numpy(random_blocks(T[name], out, inp // block, seed=s)) for s in range(copies)]
            packs = ([ours.quant_pack(r, qtype) for r in raws], [theirs.quant_pack(r, qtype) for r in raws])
            for rows in args.rows:
                x = torch.randn(rows, inp).to(getattr(torch, args.dtype))
                same = torch.equal(ours.quant_linear(x, packs[0][0], qtype, out, 0),
                                   theirs.quant_linear(x, packs[1][0], qtype, out, 0))  # fmt: skip
                used = packs if rows == 1 else (packs[0][:8], packs[1][:8])
                ratios = ratio(ours, theirs, used, qtype, out, x)
                print(f"{name} [{out}, {inp}] {rows} rows: this/other {ratios[2]:.3f} (range {ratios[0]:.2f}-"
                      f"{ratios[-1]:.2f}); packed {packs[0][0].numel() / 1e6:.2f} vs {packs[1][0].numel() / 1e6:.2f} MB"
                      f"{'' if same else '; RESULTS DIFFER'}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
