"""A small model of any natively served architecture as a user gets it: random weights built with transformers,
written by llama.cpp's own ``convert_hf_to_gguf.py`` and quantized by its ``llama-quantize`` (Q4_K_M by default),
with the bundled SmolLM2's tokenizer. Prints the file's path, for ``bench_user_model.py --gguf``.

    .venv/bin/python bench/tiny_gguf.py gemma3 --llama-cpp ~/.cache/llama-server-0.3.36/src/vendor/llama.cpp

The converter needs ``sentencepiece`` (``pip install sentencepiece``); ``llama-quantize`` builds from the same tree
(``cmake --build build --target llama-quantize``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def main() -> None:
    import torch
    from gguf_files import convert, save_checkpoint

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", choices=["llama", "qwen2", "qwen3", "phi3", "gemma3"])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, built")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--shape", nargs="*", default=[], help="config fields, e.g. head_dim=256 num_key_value_heads=1")
    args = parser.parse_args()
    shape = {name: int(value) for name, value in (item.split("=") for item in args.shape)}
    label = "".join(f"-{name}{value}" for name, value in shape.items())
    out = args.out / f"tiny-{args.arch}-{args.hidden}x{args.layers}{label}-{args.type}.gguf"
    with tempfile.TemporaryDirectory() as work:
        save_checkpoint(args.arch, Path(work), args.hidden, args.layers, torch.bfloat16, **shape)
        dense = Path(work) / "model-f16.gguf"
        convert(Path(work), dense, args.llama_cpp, "f16")
        quantize = args.llama_cpp / "build" / "bin" / "llama-quantize"
        subprocess.run([str(quantize), str(dense), str(out), args.type], check=True, capture_output=True)
    print(out)


if __name__ == "__main__":
    main()
