"""A mixture of experts' decode step: the routed experts in one native call (``csrc/experts.cpp``) against the same
ops dispatched expert by expert from Python, on one engine (the same packed weights), steps alternated.

    .venv/bin/python bench/shaped_gguf.py qwen3-30b-a3b --out /tmp/qwen3-30b-a3b-shaped.gguf
    .venv/bin/python bench/bench_experts.py --gguf /tmp/qwen3-30b-a3b-shaped.gguf --batches 1 8 32

Prints, at each batch size, the median step time of each way and their ratio. The tokens are the same either way
(``tests/test_architectures.py`` checks it bitwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    from engine.core.types import GenerationRequest
    from engine.runtime import loader
    from engine.runtime.batch_engine import HFEngine

    began = time.perf_counter()
    loaded = loader.load(str(args.gguf), blocks=True)
    quantized = loaded.blocks
    engine = HFEngine(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        capacity=max(args.batches),
        max_model_len=512,
        kv_cache_bytes=1 << 30,
        max_num_batched_tokens=512,
        prefix_caching=False,
        quantized=quantized,
    )
    print(f"loaded in {time.perf_counter() - began:.1f} s", flush=True)
    runner = engine._runner
    native = runner._moe
    for batch in args.batches:
        engine.admit([GenerationRequest(tuple(range(100 + i, 130 + i)), 2 * args.steps + 8, ignore_eos=True)
                      for i in range(batch)])  # fmt: skip
        for _ in range(3):
            engine.step()
        times: dict[str, list[float]] = {"native": [], "python": []}
        for _ in range(args.steps):
            for name, op in (("native", native), ("python", None)):
                runner._moe = op
                start = time.perf_counter()
                engine.step()
                times[name].append((time.perf_counter() - start) * 1000)
        runner._moe = native
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(
            f"batch {batch}: decode step native {medians['native']:.1f} ms, expert by expert from Python "
            f"{medians['python']:.1f} ms ({medians['native'] / medians['python']:.2f}x)",
            flush=True,
        )
        engine.reset()


if __name__ == "__main__":
    main()
