"""A GGUF's quantized weight matrices as they are stored, for the native quantized matmul
(``csrc/quant_matmul.cpp``, through ``engine/runtime/quantized_weights.py``): every type in ``SUPPORTED``; matrices of
other types (F16, BF16, F32) are left to the dense path.

Names are transformers' names (``model.layers.3.mlp.up_proj.weight``); in a llama file the rows of the query and
key projections are put back in transformers' order (llama.cpp's converter stores them permuted for its RoPE), as
transformers does when it dequantizes the file, so a quantized matrix and the dequantized one hold the same rows.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from engine.core.architectures import ARCHITECTURES, Architecture
from engine.runtime.quantized_weights import SUPPORTED, QuantizedWeight

if TYPE_CHECKING:
    from engine.runtime.gguf_file import GGUFFile

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate",  # a mixture of experts' router
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",  # ... its shared expert
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",  # ... and the shared expert's gate
}
#: ... in an architecture that stores them fused (``Architecture.fused_projections``).
_FUSED_NAMES = {**_LAYER_NAMES, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
#: ... in gpt-oss (``Architecture.oai_experts``): its router and its attention sinks.
_OAI_NAMES = {**_LAYER_NAMES, "attn_sinks": "self_attn.sinks"}
#: ... in Qwen3.5 (``Architecture.delta_net``): its linear attention's projections.
_DELTA_NAMES = {
    **_LAYER_NAMES, "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
    "ssm_beta": "linear_attn.in_proj_b", "ssm_alpha": "linear_attn.in_proj_a", "ssm_out": "linear_attn.out_proj",
}  # fmt: skip
#: ... in Granite 4.0-H (``Architecture.mamba``): its Mamba-2 layers' projections.
_MAMBA_NAMES = {**_LAYER_NAMES, "ssm_in": "mamba.in_proj", "ssm_out": "mamba.out_proj"}
#: ... Granite 4.0-H's MLP (``Architecture.stacked_mlp``), dense or beside a mixture: its gate's and up's halves
#: by llama's names (transformers stacks them), its output by transformers'.
_SHARED_MLP = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "output_linear", "ffn_gate_shexp": "gate_proj",
               "ffn_up_shexp": "up_proj", "ffn_down_shexp": "output_linear"}  # fmt: skip
#: Gemma 4's per-layer inputs' matrices: the model's (by the file's whole name) and each layer's.
_PER_LAYER_NAMES = {"per_layer_token_embd.weight": "model.embed_tokens_per_layer.weight",
                    "per_layer_model_proj.weight": "model.per_layer_model_projection.weight"}  # fmt: skip
_PER_LAYER_LAYER = {"inp_gate": "per_layer_input_gate", "proj": "per_layer_projection"}
#: A mixture of experts' matrices (3-D: one matrix an expert, ``expert_name``).
EXPERT_PROJECTIONS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}


def read(path: Path | GGUFFile, num_heads: int, num_kv_heads: int) -> dict[str, QuantizedWeight]:
    """The quantized matrices of the GGUF at ``path`` (or open) that the native matmul reads, by transformers'
    name. The tied output projection is the token embedding's matrix (``lm_head.weight``) unless the file has its
    own."""
    from engine.runtime.gguf_file import GGUFFile

    reader = path if isinstance(path, GGUFFile) else GGUFFile(path)
    permuted = permuted_qk(reader)
    arch = ARCHITECTURES[architecture(reader)]
    weights: dict[str, QuantizedWeight] = {}
    for tensor in reader.tensors:
        qtype = SUPPORTED.get(tensor.tensor_type.name)
        if qtype is not None and tensor.name.split(".")[2:3] and tensor.name.split(".")[2] in EXPERT_PROJECTIONS:
            weights.update(_experts(tensor.name, np.asarray(tensor.data), qtype, int(tensor.shape[0])))
            continue
        if qtype is not None and tensor.name.endswith(".ssm_ba.weight"):  # Qwen3-Next's beta and alpha rows
            beta, alpha = split_beta_alpha(tensor.name, np.asarray(tensor.data), reader)
            weights.update({name: QuantizedWeight(_mapped(rows), qtype, int(tensor.shape[0]))
                            for name, rows in (beta, alpha)})  # fmt: skip
            continue
        name = hf_name(tensor.name, arch)
        if qtype is None or name is None:
            continue
        rows = np.asarray(tensor.data)
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            rows = unpermute_rows(rows, num_heads if ".attn_q." in tensor.name else num_kv_heads)
        in_features = int(tensor.shape[0])  # GGUF lists dimensions innermost first
        weights[name] = QuantizedWeight(_mapped(rows), qtype, in_features)
    if "lm_head.weight" not in weights and "model.embed_tokens.weight" in weights:
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
    return weights


def expert_name(layer: int | str, expert: int, projection: str) -> str:
    """The name an expert's matrix goes by among the quantized ones (transformers holds an MoE layer's experts as
    two 3-D parameters, ``mlp.experts.gate_up_proj`` and ``down_proj``)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def parse_expert_name(name: str) -> tuple[str, int, str] | None:
    """``expert_name``'s layer, expert and projection; None for any other name."""
    parts = name.split(".")
    if len(parts) != 8 or parts[3:5] != ["mlp", "experts"]:
        return None
    return parts[2], int(parts[5]), parts[6]


def _experts(name: str, blocks: np.ndarray, qtype: int, in_features: int) -> dict[str, QuantizedWeight]:
    """A 3-D expert tensor's matrices, one an expert (``[experts, out, bytes per row]``: each expert's rows of
    blocks lie together in the file)."""
    _, layer, kind, _ = name.split(".")
    return {
        expert_name(layer, expert, EXPERT_PROJECTIONS[kind]): QuantizedWeight(
            _mapped(blocks[expert]), qtype, in_features
        )
        for expert in range(blocks.shape[0])
    }


def _mapped(rows: np.ndarray) -> torch.Tensor:
    """``rows`` as a tensor without a copy where they are the file's own bytes (a view of its read-only memory map:
    the kernels' packing reads them once, and the pages stay the page cache's, not the process's); a copy where
    they are not contiguous."""
    if not rows.flags.c_contiguous:
        return torch.from_numpy(np.ascontiguousarray(rows))
    with warnings.catch_warnings():  # read-only: nothing writes blocks; packing and dequantizing copy them
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(rows)


def split_beta_alpha(
    name: str, rows: np.ndarray, reader: GGUFFile
) -> tuple[tuple[str, np.ndarray], tuple[str, np.ndarray]]:
    """Qwen3-Next's ``blk.N.ssm_ba`` (each key head's value heads' beta rows, then their alpha rows: transformers'
    ``in_proj_ba``) as Qwen3.5's ``in_proj_b`` and ``in_proj_a`` (value heads in order), whole rows moved."""
    layer = name.split(".")[1]
    key_heads = int(reader.keys[f"{architecture(reader)}.ssm.group_count"])
    groups = rows.reshape(key_heads, 2, -1, *rows.shape[1:])
    beta, alpha = (np.ascontiguousarray(groups[:, i]).reshape(-1, *rows.shape[1:]) for i in (0, 1))
    prefix = f"model.layers.{layer}.linear_attn"
    return (f"{prefix}.in_proj_b.weight", beta), (f"{prefix}.in_proj_a.weight", alpha)


def architecture(reader: GGUFFile) -> str:
    """The file's ``general.architecture``."""
    return str(reader.keys["general.architecture"])


def permuted_qk(reader: GGUFFile) -> bool:
    """Whether the file's query and key rows are stored permuted for llama.cpp's RoPE (its llama converter)."""
    arch = ARCHITECTURES.get(architecture(reader))
    return arch is not None and arch.permuted_qk


def hf_name(name: str, arch: Architecture) -> str | None:
    """transformers' name of a projection's weight or bias (or of the embedding or output layer) in a file of
    ``arch``."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output.weight":
        return "lm_head.weight"
    if name in _PER_LAYER_NAMES:
        return _PER_LAYER_NAMES[name]
    parts = name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _PER_LAYER_LAYER and parts[3] == "weight":
        return f"model.layers.{parts[1]}.{_PER_LAYER_LAYER[parts[2]]}.weight"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] == "layer_output_scale":  # Gemma 4's (a buffer)
        return f"model.layers.{parts[1]}.layer_scalar"
    if len(parts) == 5 and parts[0] == "blk" and parts[2] == "shortconv":  # LFM2's short convolution
        return f"model.layers.{parts[1]}.conv.{parts[3]}.{parts[4]}"
    if arch.stacked_mlp and len(parts) == 4 and parts[2] in _SHARED_MLP:  # Granite 4.0-H's MLP: the shared one
        own = arch.stacked_mlp.rpartition(".")[0]
        return f"model.layers.{parts[1]}.{own}.{_SHARED_MLP[parts[2]]}.{parts[3]}"
    names = (_FUSED_NAMES if arch.fused_projections else _OAI_NAMES if arch.oai_experts
             else _DELTA_NAMES if arch.delta_net else _MAMBA_NAMES if arch.mamba else _LAYER_NAMES)  # fmt: skip
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names and parts[3] in ("weight", "bias"):
        suffix = "" if parts[2] == "attn_sinks" else f".{parts[3]}"  # a parameter of its own, not a layer's weight
        module, _, rest = names[parts[2]].partition(".")
        if module == "mlp":  # the family's MLP module, and its router's name (``Architecture.mlp``, ``router``)
            module, rest = arch.mlp, arch.router if parts[2] == "ffn_gate_inp" else rest
        return f"model.layers.{parts[1]}.{arch.name(f'{module}.{rest}')}{suffix}"
    return None


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's RoPE permutation of the query/key rows (on whole rows of blocks)."""
    dim = rows.shape[0] // heads // 2
    return rows.reshape(heads, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)
