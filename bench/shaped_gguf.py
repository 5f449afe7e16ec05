"""A GGUF of a released checkpoint's shape with random weights, written directly in its quantized blocks (no float
intermediate: a 20B does not fit as float16 here), for speed measurements: what a real file of that shape costs a
step is what this one costs. The tokenizer is the Qwen2.5-Coder GGUF's (``../shared/tools/user-models.sh``), its
token list padded with unused tokens to the shape's vocabulary. Prints the file's path.

    .venv/bin/python bench/shaped_gguf.py gpt-oss-20b --out /tmp/gpt-oss-20b-shaped.gguf

Shapes: ``gpt-oss-20b`` as released (experts MXFP4, the rest as ``llama-quantize MXFP4_MOE`` writes it: Q8_0
matrices, F32 router, biases, norms and sinks).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, RopeScalingType

ROOT = Path(__file__).resolve().parent.parent
USER_MODELS = ROOT.parent / "shared" / "tools" / "user-models.sh"
T = GGMLQuantizationType

#: gpt-oss-20b's config (openai/gpt-oss-20b): 24 layers of 32 experts, 4 a token.
GPT_OSS_20B = {
    "layers": 24, "hidden": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "experts": 32, "used": 4,
    "expert_ff": 2880, "vocab": 201088, "window": 128, "context": 131072, "rope_theta": 150000.0,
    "yarn_factor": 32.0, "yarn_original": 4096, "eps": 1e-5,
}  # fmt: skip


def tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """Each tensor's name, its shape (outermost first, as numpy holds it) and type."""
    hidden, heads, kv, dim = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    experts, ff = shape["experts"], shape["expert_ff"]
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q8_0
    for i in range(shape["layers"]):
        blk = f"blk.{i}"
        yield f"{blk}.attn_norm.weight", (hidden,), T.F32
        yield f"{blk}.post_attention_norm.weight", (hidden,), T.F32
        for name, rows in (("attn_q", heads * dim), ("attn_k", kv * dim), ("attn_v", kv * dim)):
            yield f"{blk}.{name}.weight", (rows, hidden), T.Q8_0
            yield f"{blk}.{name}.bias", (rows,), T.F32
        yield f"{blk}.attn_output.weight", (hidden, heads * dim), T.Q8_0
        yield f"{blk}.attn_output.bias", (hidden,), T.F32
        yield f"{blk}.attn_sinks.weight", (heads,), T.F32
        yield f"{blk}.ffn_gate_inp.weight", (experts, hidden), T.F32
        yield f"{blk}.ffn_gate_inp.bias", (experts,), T.F32
        for name in ("ffn_gate_exps", "ffn_up_exps"):
            yield f"{blk}.{name}.weight", (experts, ff, hidden), T.MXFP4
            yield f"{blk}.{name}.bias", (experts, ff), T.F32
        yield f"{blk}.ffn_down_exps.weight", (experts, hidden, ff), T.MXFP4
        yield f"{blk}.ffn_down_exps.bias", (experts, hidden), T.F32
    yield "output_norm.weight", (hidden,), T.F32
    yield "output.weight", (shape["vocab"], hidden), T.Q8_0


def values(name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random values of a plausible size: norms about 1, matrices' weights about 0.02, biases and sinks small; in
    blocks, valid scales (fp16 for Q8_0, an E8M0 exponent for MXFP4) over random quants."""
    if kind == T.F32:
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (*dims[:-1], dims[-1] // block, size), dtype=np.uint8)
    if kind == T.Q8_0:  # d about 3e-4: int8 quants of std ~73 make weights of ~0.02
        raw[..., :2] = np.array([3e-4], dtype=np.float16).view(np.uint8)
    else:  # MXFP4: 2^(119 - 128) times E2M1 values of std ~6: ~0.012
        raw[..., 0] = 119
    return raw.reshape(*dims[:-1], -1)


def write(shape: dict, out: Path, tokenizer_from: Path, seed: int = 0) -> None:
    writer = GGUFWriter(out, "gpt-oss")
    _keys(writer, shape)
    _tokenizer(writer, GGUFReader(tokenizer_from), shape["vocab"])
    rng = np.random.default_rng(seed)
    listed = list(tensors(shape))
    for name, dims, kind in listed:
        block, size = GGML_QUANT_SIZES[kind]
        byte_shape = dims if kind == T.F32 else (*dims[:-1], dims[-1] // block * size)
        nbytes = int(np.prod(byte_shape)) * (4 if kind == T.F32 else 1)
        dtype = np.float32 if kind == T.F32 else np.uint8
        writer.add_tensor_info(name, byte_shape, np.dtype(dtype), nbytes, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims, kind in listed:  # one tensor in memory at a time
        writer.write_tensor_data(values(name, dims, kind, rng))
    writer.close()


def _keys(writer: GGUFWriter, shape: dict) -> None:
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(shape["expert_ff"])
    writer.add_expert_feed_forward_length(shape["expert_ff"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_layer_norm_rms_eps(shape["eps"])
    writer.add_expert_count(shape["experts"])
    writer.add_expert_used_count(shape["used"])
    writer.add_sliding_window(shape["window"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(shape["yarn_factor"])
    writer.add_rope_scaling_orig_ctx_len(shape["yarn_original"])
    writer.add_file_type(38)  # MOSTLY_MXFP4_MOE


def _tokenizer(writer: GGUFWriter, reader: GGUFReader, vocab: int) -> None:
    """The tokenizer's keys, its tokens padded with unused ones to ``vocab`` (the embedding's rows)."""
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer.") or name == "tokenizer.chat_template":
            continue
        contents = field.contents()
        if name in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            padding = vocab - len(contents)
            contents = [*contents, *([f"<|unused_{i}|>" for i in range(padding)] if name.endswith("tokens")
                                     else [4] * padding)]  # fmt: skip
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(name, contents)
        else:
            writer.add_key_value(name, contents, field.types[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=["gpt-oss-20b"])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF whose tokenizer to take")
    args = parser.parse_args()
    source = args.tokenizer_from or Path(subprocess.check_output(["bash", str(USER_MODELS)], text=True).strip())
    write(GPT_OSS_20B, args.out, source)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
