"""A GGUF of a released checkpoint's shape with random weights, written directly in its quantized blocks (no float
intermediate: a 20B does not fit as float16 here), for speed measurements: what a real file of that shape costs a
step is what this one costs. The tokenizer is the Qwen2.5-Coder GGUF's (``../shared/tools/user-models.sh``), its
token list padded with unused tokens to the shape's vocabulary. Prints the file's path.

    .venv/bin/python bench/shaped_gguf.py gpt-oss-20b --out /tmp/gpt-oss-20b-shaped.gguf

Shapes: ``gpt-oss-20b`` as released (experts MXFP4, the rest as ``llama-quantize MXFP4_MOE`` writes it: Q8_0
matrices, F32 router, biases, norms and sinks); ``qwen3-30b-a3b`` (Qwen/Qwen3-30B-A3B: 48 layers of 128 experts, 8
a token) typed as ``llama-quantize Q4_K_M`` types it (Q4_K, with Q6_K for the value rows and the experts' down
rows of half the layers, its ``use_more_bits`` ones, and for the output layer; an 18.6 GB file); ``lfm2-1.2b``
(LiquidAI/LFM2-1.2B: 10 short-convolution and 6 attention layers) and ``qwen3.5-0.8b`` (Qwen3.5's layout at about
0.8B: 24 layers, 18 of them Gated DeltaNet, hidden 1,024; its vocabulary and RoPE base as Qwen3.5's, its linear
attention's heads as Qwen3-Next's; the small size's own config was not at hand offline) and ``granite-4.0-h-1b``
(ibm-granite/granite-4.0-h-1b: 36 Mamba-2 and 4 attention layers, hidden 1,536) and ``gemma-4-e2b``
(google/gemma-4-E2B's text model: 35 layers, 20 of them reading earlier layers' KV, per-layer inputs), their
matrices Q8_0 (as ``llama-quantize Q8_0`` writes them), norms, convolutions and the recurrent layers' vectors F32;
and a dense ``qwen2.5-7b`` (Qwen/Qwen2.5-7B-Instruct: 28 layers of 3,584) typed as ``llama-quantize Q4_K_M`` types
it (a 4.7 GB file).
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

#: Qwen2.5-7B's config (Qwen/Qwen2.5-7B-Instruct): a dense 7B, 28 layers of 3,584, QKV biases.
QWEN25_7B = {
    "arch": "qwen2", "layers": 28, "hidden": 3584, "heads": 28, "kv_heads": 4, "head_dim": 128, "ff": 18944,
    "vocab": 152064, "context": 32768, "rope_theta": 1e6, "eps": 1e-6,
}  # fmt: skip

#: gpt-oss-20b's config (openai/gpt-oss-20b): 24 layers of 32 experts, 4 a token.
GPT_OSS_20B = {
    "layers": 24, "hidden": 2880, "heads": 64, "kv_heads": 8, "head_dim": 64, "experts": 32, "used": 4,
    "expert_ff": 2880, "vocab": 201088, "window": 128, "context": 131072, "rope_theta": 150000.0,
    "yarn_factor": 32.0, "yarn_original": 4096, "eps": 1e-5,
}  # fmt: skip


#: LiquidAI/LFM2-1.2B's config: 16 layers, attention at 2, 5, 8, 10, 12 and 14; the MLP's 12,288 adjusted to 8,192.
#: Its vocabulary is the borrowed tokenizer's 151,936 (LFM2's own: 65,536): both servers pay the larger output layer.
LFM2_1_2B = {
    "arch": "lfm2", "layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "head_dim": 64, "ff": 8192,
    "vocab": 151936, "context": 128000, "rope_theta": 1e6, "eps": 1e-5, "span": 3, "attention": (2, 5, 8, 10, 12, 14),
}  # fmt: skip
#: Qwen3.5's layout at about 0.8B: 24 layers, every 4th full attention (8 heads of 256, 2 KV heads, a quarter
#: rotated), linear attention of 16 key and 16 value heads of 128; Qwen3.5's vocabulary and RoPE base.
QWEN35_0_8B = {
    "arch": "qwen35", "layers": 24, "hidden": 1024, "heads": 8, "kv_heads": 2, "head_dim": 256, "ff": 3584,
    "vocab": 248320, "context": 262144, "rope_theta": 1e7, "eps": 1e-6, "span": 4, "key_heads": 16,
    "value_heads": 16, "key_dim": 128, "value_dim": 128,
}  # fmt: skip
#: ibm-granite/granite-4.0-h-1b's config: 40 layers, attention (12 heads of 128, 4 KV heads, no RoPE) at 5, 15, 25
#: and 35, the others Mamba-2 (48 heads of 64, B and C of 128 in one group); tied; Granite 4.0-H-350M's multipliers.
#: Its vocabulary is the borrowed tokenizer's 151,936 (Granite's own: 100,352): both servers pay the larger output.
GRANITE_40_H_1B = {
    "arch": "granitehybrid", "layers": 40, "hidden": 1536, "heads": 12, "kv_heads": 4, "head_dim": 128, "ff": 4096,
    "vocab": 151936, "context": 131072, "rope_theta": 10000.0, "eps": 1e-5, "span": 4, "attention": (5, 15, 25, 35),
    "ssm_heads": 48, "ssm_head_dim": 64, "state": 128, "groups": 1,
}  # fmt: skip
#: Qwen/Qwen3-30B-A3B's config: 48 layers of 128 experts of 768, 8 a token, their weights renormalized.
QWEN3_30B_A3B = {
    "arch": "qwen3moe", "layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 128,
    "used": 8, "ff": 6144, "expert_ff": 768, "vocab": 151936, "context": 40960, "rope_theta": 1e6, "eps": 1e-6,
}  # fmt: skip
#: google/gemma-4-E2B's text model: 35 layers, every 5th global (heads of 512, a quarter rotated) and the others
#: local (heads of 256, 512 positions), one KV head; the last 20 layers read the KV of the last layer of their kind
#: before them (with an MLP twice as wide); per-layer inputs of 256 a layer (a 262,144 x 8,960 table); soft-capped.
GEMMA4_E2B = {
    "arch": "gemma4", "layers": 35, "hidden": 1536, "heads": 8, "kv_heads": 1, "head_dim": 256, "global_dim": 512,
    "ff": 6144, "vocab": 262144, "context": 131072, "rope_theta": 1e6, "eps": 1e-6, "window": 512, "period": 5,
    "shared": 20, "per_layer": 256, "softcap": 30.0,
}  # fmt: skip
SHAPES = {
    "gpt-oss-20b": GPT_OSS_20B, "qwen3-30b-a3b": QWEN3_30B_A3B, "lfm2-1.2b": LFM2_1_2B, "qwen3.5-0.8b": QWEN35_0_8B,
    "granite-4.0-h-1b": GRANITE_40_H_1B, "gemma-4-e2b": GEMMA4_E2B, "qwen2.5-7b": QWEN25_7B,
}  # fmt: skip


def tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """Each tensor's name, its shape (outermost first, as numpy holds it) and type."""
    if shape.get("arch") == "lfm2":
        yield from _lfm2_tensors(shape)
        return
    if shape.get("arch") == "qwen35":
        yield from _qwen35_tensors(shape)
        return
    if shape.get("arch") == "qwen3moe":
        yield from _qwen3moe_tensors(shape)
        return
    if shape.get("arch") == "qwen2":
        yield from _qwen2_tensors(shape)
        return
    if shape.get("arch") == "granitehybrid":
        yield from _granite_hybrid_tensors(shape)
        return
    if shape.get("arch") == "gemma4":
        yield from _gemma4_tensors(shape)
        return
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


def _dense_layer(blk: str, shape: dict, mlp_norm: str) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """A layer's norms and gated MLP (Q8_0)."""
    hidden, ff = shape["hidden"], shape["ff"]
    yield f"{blk}.attn_norm.weight", (hidden,), T.F32
    yield f"{blk}.{mlp_norm}.weight", (hidden,), T.F32
    yield f"{blk}.ffn_gate.weight", (ff, hidden), T.Q8_0
    yield f"{blk}.ffn_up.weight", (ff, hidden), T.Q8_0
    yield f"{blk}.ffn_down.weight", (hidden, ff), T.Q8_0


def _attention(blk: str, shape: dict, query_rows: int) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    hidden, heads, kv, dim = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    for name, rows in (("attn_q", query_rows), ("attn_k", kv * dim), ("attn_v", kv * dim)):
        yield f"{blk}.{name}.weight", (rows, hidden), T.Q8_0
    yield f"{blk}.attn_output.weight", (hidden, heads * dim), T.Q8_0
    yield f"{blk}.attn_q_norm.weight", (dim,), T.F32
    yield f"{blk}.attn_k_norm.weight", (dim,), T.F32


def _lfm2_tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    hidden = shape["hidden"]
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q8_0  # tied: the output layer too
    for i in range(shape["layers"]):
        blk = f"blk.{i}"
        yield from _dense_layer(blk, shape, "ffn_norm")
        if i in shape["attention"]:
            yield from _attention(blk, shape, shape["heads"] * shape["head_dim"])
            continue
        yield f"{blk}.shortconv.in_proj.weight", (3 * hidden, hidden), T.Q8_0
        yield f"{blk}.shortconv.out_proj.weight", (hidden, hidden), T.Q8_0
        yield f"{blk}.shortconv.conv.weight", (hidden, shape["span"]), T.F32
    yield "token_embd_norm.weight", (hidden,), T.F32


def _qwen35_tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    hidden = shape["hidden"]
    keys, values_ = shape["key_heads"] * shape["key_dim"], shape["value_heads"] * shape["value_dim"]
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q8_0
    for i in range(shape["layers"]):
        blk = f"blk.{i}"
        yield from _dense_layer(blk, shape, "post_attention_norm")
        if (i + 1) % 4 == 0:
            yield from _attention(blk, shape, 2 * shape["heads"] * shape["head_dim"])  # a gate beside each head
            continue
        yield f"{blk}.attn_qkv.weight", (2 * keys + values_, hidden), T.Q8_0
        yield f"{blk}.attn_gate.weight", (values_, hidden), T.Q8_0
        yield f"{blk}.ssm_beta.weight", (shape["value_heads"], hidden), T.F32
        yield f"{blk}.ssm_alpha.weight", (shape["value_heads"], hidden), T.F32
        yield f"{blk}.ssm_conv1d.weight", (2 * keys + values_, shape["span"]), T.F32
        yield f"{blk}.ssm_dt.bias", (shape["value_heads"],), T.F32
        yield f"{blk}.ssm_a", (shape["value_heads"],), T.F32
        yield f"{blk}.ssm_norm.weight", (shape["value_dim"],), T.F32
        yield f"{blk}.ssm_out.weight", (hidden, values_), T.Q8_0
    yield "output_norm.weight", (hidden,), T.F32
    yield "output.weight", (shape["vocab"], hidden), T.Q8_0


def _granite_hybrid_tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    hidden, heads, dim = shape["hidden"], shape["heads"], shape["head_dim"]
    inner, shared = shape["ssm_heads"] * shape["ssm_head_dim"], shape["groups"] * shape["state"]
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q8_0  # tied: the output layer too
    for i in range(shape["layers"]):
        blk = f"blk.{i}"
        yield from _dense_layer(blk, shape, "ffn_norm")
        if i in shape["attention"]:
            for name, rows in (("attn_q", heads * dim), ("attn_k", shape["kv_heads"] * dim),
                               ("attn_v", shape["kv_heads"] * dim)):  # fmt: skip
                yield f"{blk}.{name}.weight", (rows, hidden), T.Q8_0
            yield f"{blk}.attn_output.weight", (hidden, heads * dim), T.Q8_0
            continue
        yield f"{blk}.ssm_in.weight", (2 * inner + 2 * shared + shape["ssm_heads"], hidden), T.Q8_0
        yield f"{blk}.ssm_conv1d.weight", (inner + 2 * shared, shape["span"]), T.F32
        yield f"{blk}.ssm_conv1d.bias", (inner + 2 * shared,), T.F32
        yield f"{blk}.ssm_dt.bias", (shape["ssm_heads"],), T.F32
        yield f"{blk}.ssm_a", (shape["ssm_heads"], 1), T.F32
        yield f"{blk}.ssm_d", (shape["ssm_heads"], 1), T.F32
        yield f"{blk}.ssm_norm.weight", (shape["groups"], inner // shape["groups"]), T.F32
        yield f"{blk}.ssm_out.weight", (hidden, inner), T.Q8_0
    yield "output_norm.weight", (hidden,), T.F32


def _gemma4_tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """Gemma 4's: the embedding and the per-layer inputs' table and projection; each layer's attention (no key or
    value of its own in the KV-sharing layers), four norms, MLP, per-layer input's gate, projection and norm, and
    scalar; the global layers' RoPE factors."""
    hidden, layers, width = shape["hidden"], shape["layers"], shape["per_layer"]
    yield "rope_freqs.weight", (shape["global_dim"] // 2,), T.F32
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q8_0
    yield "per_layer_token_embd.weight", (shape["vocab"], layers * width), T.Q8_0
    yield "per_layer_model_proj.weight", (layers * width, hidden), T.Q8_0
    yield "per_layer_proj_norm.weight", (width,), T.F32
    for i in range(layers):
        blk, dim = f"blk.{i}", shape["global_dim"] if _gemma4_global(i, shape) else shape["head_dim"]
        own_kv = i < layers - shape["shared"]
        ff = shape["ff"] * (1 if own_kv else 2)
        yield f"{blk}.attn_norm.weight", (hidden,), T.F32
        yield f"{blk}.attn_q.weight", (shape["heads"] * dim, hidden), T.Q8_0
        yield f"{blk}.attn_q_norm.weight", (dim,), T.F32
        if own_kv:
            yield f"{blk}.attn_k.weight", (shape["kv_heads"] * dim, hidden), T.Q8_0
            yield f"{blk}.attn_v.weight", (shape["kv_heads"] * dim, hidden), T.Q8_0
            yield f"{blk}.attn_k_norm.weight", (dim,), T.F32
        yield f"{blk}.attn_output.weight", (hidden, shape["heads"] * dim), T.Q8_0
        for norm in ("post_attention_norm", "ffn_norm", "post_ffw_norm", "post_norm"):
            yield f"{blk}.{norm}.weight", (hidden,), T.F32
        yield f"{blk}.ffn_gate.weight", (ff, hidden), T.Q8_0
        yield f"{blk}.ffn_up.weight", (ff, hidden), T.Q8_0
        yield f"{blk}.ffn_down.weight", (hidden, ff), T.Q8_0
        yield f"{blk}.inp_gate.weight", (width, hidden), T.Q8_0
        yield f"{blk}.proj.weight", (hidden, width), T.Q8_0
        yield f"{blk}.layer_output_scale.weight", (1,), T.F32
    yield "output_norm.weight", (hidden,), T.F32


def _gemma4_global(layer: int, shape: dict) -> bool:
    return (layer + 1) % shape["period"] == 0


def _more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the layers whose value rows and down rows Q4_K_M keeps in Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _qwen3moe_tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    hidden, heads, kv, dim = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    experts, ff, layers = shape["experts"], shape["expert_ff"], shape["layers"]
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q4_K
    for i in range(layers):
        blk, more = f"blk.{i}", _more_bits(i, layers)
        yield f"{blk}.attn_norm.weight", (hidden,), T.F32
        yield f"{blk}.ffn_norm.weight", (hidden,), T.F32
        yield f"{blk}.attn_q.weight", (heads * dim, hidden), T.Q4_K
        yield f"{blk}.attn_k.weight", (kv * dim, hidden), T.Q4_K
        yield f"{blk}.attn_v.weight", (kv * dim, hidden), T.Q6_K if more else T.Q4_K
        yield f"{blk}.attn_output.weight", (hidden, heads * dim), T.Q4_K
        yield f"{blk}.attn_q_norm.weight", (dim,), T.F32
        yield f"{blk}.attn_k_norm.weight", (dim,), T.F32
        yield f"{blk}.ffn_gate_inp.weight", (experts, hidden), T.F32
        yield f"{blk}.ffn_gate_exps.weight", (experts, ff, hidden), T.Q4_K
        yield f"{blk}.ffn_up_exps.weight", (experts, ff, hidden), T.Q4_K
        yield f"{blk}.ffn_down_exps.weight", (experts, hidden, ff), T.Q6_K if more else T.Q4_K
    yield "output_norm.weight", (hidden,), T.F32
    yield "output.weight", (shape["vocab"], hidden), T.Q6_K


def _qwen2_tensors(shape: dict) -> Iterator[tuple[str, tuple[int, ...], GGMLQuantizationType]]:
    """A dense Qwen2's, typed as ``llama-quantize Q4_K_M`` types it (Q6_K value and down rows in its
    ``use_more_bits`` layers, and the output layer)."""
    hidden, heads, kv, dim = shape["hidden"], shape["heads"], shape["kv_heads"], shape["head_dim"]
    layers = shape["layers"]
    yield "token_embd.weight", (shape["vocab"], hidden), T.Q4_K
    for i in range(layers):
        blk, more = f"blk.{i}", _more_bits(i, layers)
        yield f"{blk}.attn_norm.weight", (hidden,), T.F32
        yield f"{blk}.ffn_norm.weight", (hidden,), T.F32
        for name, rows in (("attn_q", heads * dim), ("attn_k", kv * dim), ("attn_v", kv * dim)):
            yield f"{blk}.{name}.weight", (rows, hidden), T.Q6_K if more and name == "attn_v" else T.Q4_K
            yield f"{blk}.{name}.bias", (rows,), T.F32
        yield f"{blk}.attn_output.weight", (hidden, heads * dim), T.Q4_K
        yield f"{blk}.ffn_gate.weight", (shape["ff"], hidden), T.Q4_K
        yield f"{blk}.ffn_up.weight", (shape["ff"], hidden), T.Q4_K
        yield f"{blk}.ffn_down.weight", (hidden, shape["ff"]), T.Q6_K if more else T.Q4_K
    yield "output_norm.weight", (hidden,), T.F32
    yield "output.weight", (shape["vocab"], hidden), T.Q6_K


#: Where each K-quant block's fp16 scales sit, and their size: weights of about 0.02 over random quants and
#: sub-scales (Q4_K: d sc q ~ 240 d, less dmin mn; Q6_K: d sc (q - 32) ~ 1,100 d).
_K_SCALES = {T.Q4_K: ((0, 8e-5), (2, 4e-5)), T.Q6_K: ((208, 2e-5),)}


def values(name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random values of a plausible size: norms about 1, matrices' weights about 0.02, biases and sinks small; in
    blocks, valid scales (fp16 for Q8_0, an E8M0 exponent for MXFP4) over random quants."""
    if name.endswith(".ssm_a"):  # -exp(A_log): a decay of each head's matrix, negative
        return -np.exp(rng.uniform(-1.0, 1.0, dims)).astype(np.float32)
    if name == "rope_freqs.weight":  # Gemma 4's global layers: a quarter of each head's pairs turn (factor 1)
        turned = dims[0] // 4
        return np.array([1.0] * turned + [1e30] * (dims[0] - turned), dtype=np.float32)
    if name.endswith("layer_output_scale.weight"):
        return np.ones(dims, dtype=np.float32)
    if kind == T.F32:
        base = 1.0 if name.endswith("norm.weight") else 0.0
        return (base + rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float32)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (*dims[:-1], dims[-1] // block, size), dtype=np.uint8)
    if kind == T.Q8_0:  # d about 3e-4: int8 quants of std ~73 make weights of ~0.02
        raw[..., :2] = np.array([3e-4], dtype=np.float16).view(np.uint8)
    elif kind in _K_SCALES:
        for at, scale in _K_SCALES[kind]:
            raw[..., at : at + 2] = np.array([scale], dtype=np.float16).view(np.uint8)
    else:  # MXFP4: 2^(119 - 128) times E2M1 values of std ~6: ~0.012
        raw[..., 0] = 119
    return raw.reshape(*dims[:-1], -1)


def write(shape: dict, out: Path, tokenizer_from: Path, seed: int = 0) -> None:
    arch = shape.get("arch", "gpt-oss")
    writer = GGUFWriter(out, arch)
    keys = {"gpt-oss": _keys, "qwen3moe": _qwen3moe_keys, "lfm2": _hybrid_keys, "qwen35": _hybrid_keys,
            "granitehybrid": _hybrid_keys, "gemma4": _gemma4_keys, "qwen2": _qwen2_keys}  # fmt: skip
    keys[arch](writer, shape)
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


def _common_keys(writer: GGUFWriter, shape: dict, ff: int | list[int]) -> None:
    """The keys every shape's file has: layers, context, widths (``ff``: the MLP's, or each layer's), query heads,
    RoPE base, norm epsilon."""
    writer.add_block_count(shape["layers"])
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["hidden"])
    writer.add_feed_forward_length(ff)
    writer.add_head_count(shape["heads"])
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(shape["eps"])


def _mixture_keys(writer: GGUFWriter, shape: dict, ff: int) -> None:
    """The keys every mixture of experts' file has, as llama.cpp's converter writes them (``ff``: the dense MLP's
    width, or the experts' where the family has none)."""
    _common_keys(writer, shape, ff)
    writer.add_expert_feed_forward_length(shape["expert_ff"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_expert_count(shape["experts"])
    writer.add_expert_used_count(shape["used"])


def _keys(writer: GGUFWriter, shape: dict) -> None:
    """gpt-oss's: a window every other layer, YaRN."""
    _mixture_keys(writer, shape, shape["expert_ff"])
    writer.add_sliding_window(shape["window"])
    writer.add_rope_scaling_type(RopeScalingType.YARN)
    writer.add_rope_scaling_factor(shape["yarn_factor"])
    writer.add_rope_scaling_orig_ctx_len(shape["yarn_original"])
    writer.add_file_type(38)  # MOSTLY_MXFP4_MOE


def _qwen3moe_keys(writer: GGUFWriter, shape: dict) -> None:
    _mixture_keys(writer, shape, shape["ff"])
    writer.add_file_type(15)  # MOSTLY_Q4_K_M


def _qwen2_keys(writer: GGUFWriter, shape: dict) -> None:
    _common_keys(writer, shape, shape["ff"])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_file_type(15)  # MOSTLY_Q4_K_M


def _hybrid_keys(writer: GGUFWriter, shape: dict) -> None:
    """LFM2's and Qwen3.5's keys, as llama.cpp's converter writes them."""
    arch, layers = shape["arch"], shape["layers"]
    _common_keys(writer, shape, shape["ff"])
    writer.add_key_length(shape["head_dim"])
    writer.add_value_length(shape["head_dim"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(7)  # MOSTLY_Q8_0
    if arch in ("lfm2", "granitehybrid"):
        writer.add_head_count_kv([shape["kv_heads"] if i in shape["attention"] else 0 for i in range(layers)])
    if arch == "lfm2":
        writer.add_uint32("lfm2.shortconv.l_cache", shape["span"])
        return
    if arch == "granitehybrid":
        _granite_hybrid_keys(writer, shape)
        return
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_uint32(f"{arch}.ssm.conv_kernel", shape["span"])
    writer.add_uint32(f"{arch}.ssm.state_size", shape["key_dim"])
    writer.add_uint32(f"{arch}.ssm.group_count", shape["key_heads"])
    writer.add_uint32(f"{arch}.ssm.time_step_rank", shape["value_heads"])
    writer.add_uint32(f"{arch}.ssm.inner_size", shape["value_heads"] * shape["value_dim"])
    writer.add_uint32(f"{arch}.full_attention_interval", 4)
    writer.add_array(f"{arch}.attention.recurrent_layers", [(i + 1) % 4 != 0 for i in range(layers)])
    writer.add_rope_dimension_count(shape["head_dim"] // 4)
    writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])


def _granite_hybrid_keys(writer: GGUFWriter, shape: dict) -> None:
    """Granite 4.0-H's: the Mamba-2 shapes (its heads as ``time_step_rank``), no RoPE, its multipliers."""
    writer.add_ssm_conv_kernel(shape["span"])
    writer.add_ssm_state_size(shape["state"])
    writer.add_ssm_group_count(shape["groups"])
    writer.add_ssm_inner_size(shape["ssm_heads"] * shape["ssm_head_dim"])
    writer.add_ssm_time_step_rank(shape["ssm_heads"])
    writer.add_rope_scaling_finetuned(False)
    writer.add_embedding_scale(12.0)
    writer.add_attention_scale(0.015625)
    writer.add_residual_scale(0.246)
    writer.add_logit_scale(3.0)


def _gemma4_keys(writer: GGUFWriter, shape: dict) -> None:
    """Gemma 4's, as llama.cpp's converter writes them: head sizes, KV heads and MLP widths by layer, the local
    layers' flags and window, the KV-sharing layers, the per-layer inputs' width, the soft cap."""
    layers, local = shape["layers"], [not _gemma4_global(i, shape) for i in range(shape["layers"])]
    _common_keys(writer, shape, [shape["ff"] * (1 if i < layers - shape["shared"] else 2) for i in range(layers)])
    writer.add_head_count_kv(shape["kv_heads"])
    writer.add_key_length(shape["global_dim"])
    writer.add_value_length(shape["global_dim"])
    writer.add_key_length_swa(shape["head_dim"])
    writer.add_value_length_swa(shape["head_dim"])
    writer.add_rope_freq_base_swa(10000.0)
    writer.add_rope_dimension_count(shape["global_dim"])
    writer.add_rope_dimension_count_swa(shape["head_dim"])
    writer.add_sliding_window(shape["window"])
    writer.add_sliding_window_pattern(local)
    writer.add_shared_kv_layers(shape["shared"])
    writer.add_embedding_length_per_layer_input(shape["per_layer"])
    writer.add_final_logit_softcapping(shape["softcap"])
    writer.add_vocab_size(shape["vocab"])
    writer.add_file_type(7)  # MOSTLY_Q8_0


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
    parser.add_argument("shape", choices=list(SHAPES))
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="a GGUF whose tokenizer to take")
    args = parser.parse_args()
    source = args.tokenizer_from or Path(subprocess.check_output(["bash", str(USER_MODELS)], text=True).strip())
    write(SHAPES[args.shape], args.out, source)
    print(args.out)


if __name__ == "__main__":
    sys.exit(main())
