"""A GGUF of a natively served architecture (``engine/core/architectures.py``) served from its own blocks, without
converting it: the transformers model is built from its config on uninitialized memory, the file's unquantized
tensors (norms, any matrix in a type the native matmul does not read) are copied in, and the quantized matrices are
kept as blocks for the native matmul. Their dense values are made only where a path needs them (``densify``: the
start-up probe's layer, the dense twin of ``--batch-invariant off``), from the blocks by the native dequantizer, in
memory.

The other paths (``--quantization none`` or ``int8``, no native kernels, an architecture the lean runner does not
run) load the dense copy that ``engine/runtime/loader.py`` converts once.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from engine.core.architectures import ARCHITECTURES, Architecture, NotServedNatively, by_model_type, config_value
from engine.runtime.gguf_file import GGUFFile
from engine.runtime.gguf_weights import (
    EXPERT_PROJECTIONS,
    architecture,
    hf_name,
    parse_expert_name,
    permuted_qk,
    read,
    split_beta_alpha,
    unpermute_rows,
)
from engine.runtime.quantized_weights import SUPPORTED, QuantizedWeight

_NORMS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",  # gpt-oss's name of the MLP's input norm
}
#: ... where the attention's and MLP's outputs have norms too (Gemma 3): transformers' "post attention" norm is then
#: the attention output's, and the MLP's input norm is "pre feedforward".
_OUTPUT_NORMS = {
    **_NORMS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "post_norm": "post_per_layer_input_norm",  # Gemma 4's per-layer input's output
}


#: Tensors read for what they say of RoPE (``_rope_factors``, ``gguf_config``), not as parameters.
_READ_ELSEWHERE = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def build(
    path: Path, config: PretrainedConfig, dtype: torch.dtype
) -> tuple[PreTrainedModel, dict[str, QuantizedWeight]]:
    """The model of the llama GGUF at ``path`` on the CPU, and its matrices in blocks by transformers' name. The
    model's parameters that those matrices stand for hold no values until ``densify``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.to_empty(device="cpu")  # allocated, never written: the pages stay unmapped until something writes them
    if model.model.rotary_emb is not None:  # (None: no layer rotates, Granite 4.0-H)
        model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config)  # its buffers are computed
    for embedding in (model.model.embed_tokens, getattr(model.model, "embed_tokens_per_layer", None)):
        if hasattr(embedding, "scalar_embed_scale"):  # Gemma's sqrt(hidden) factor: a buffer, computed too
            embedding.embed_scale = torch.tensor(embedding.scalar_embed_scale)
    model.tie_weights()
    reader = GGUFFile(path)
    arch = ARCHITECTURES[architecture(reader)]
    _rope_factors(model, reader)
    quantized = read(reader, config.num_attention_heads, config_value(config, "num_key_value_heads"))
    quantized = {name: weight for name, weight in quantized.items() if not _unread(name, config)}
    parameters = dict(model.named_parameters(remove_duplicate=False))
    scalars = {name: buffer for name, buffer in model.named_buffers() if name.endswith(".layer_scalar")}
    for buffer in scalars.values():  # Gemma 4's layers' scalars: 1 unless the file has its own
        buffer.fill_(1.0)
    parameters.update(scalars)  # type: ignore[arg-type]
    written = set(quantized) | _experts_in_blocks(quantized, arch) | _stacked_in_blocks(quantized, arch)
    for name, values in _dense_tensors(reader, config, written):
        name, _, part = name.partition(":")  # an expert tensor: its part of transformers' 3-D parameter
        if _unread(name, config):
            continue
        if name not in parameters:  # a tensor the family's transformers model has no place for (a shared expert)
            raise NotServedNatively(f"this {arch.gguf} file's {name} has no place in transformers' {config.model_type}")
        target = _place(parameters[name].data, part, arch)
        if values.dim() != target.dim():  # LFM2's convolution: [channels, L] in the file, [channels, 1, L] here
            values = values.reshape(target.shape)
        target.copy_(values.to(dtype))
        written.add(name)
    if config.tie_word_embeddings and "model.embed_tokens.weight" in written:
        written.add("lm_head.weight")
    missing = sorted(set(parameters) - written - set(scalars))
    if missing:  # never serve memory nothing wrote
        raise NotServedNatively(f"this {architecture(reader)} file has no tensor for {', '.join(missing[:4])}")
    model.eval()
    return model, quantized


def _unread(name: str, config: PretrainedConfig) -> bool:
    """A KV-sharing layer's own key and value weights (Gemma 4's checkpoints keep them; those layers read earlier
    layers' KV): not read, as llama.cpp does not read them."""
    shared = getattr(config, "num_kv_shared_layers", 0) or 0
    parts = name.split(".")
    return (
        bool(shared) and len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "self_attn"
        and int(parts[2]) >= config.num_hidden_layers - shared and parts[4] in ("k_proj", "v_proj", "k_norm")
    )  # fmt: skip


def _experts_in_blocks(quantized: dict[str, QuantizedWeight], arch: Architecture) -> set[str]:
    """transformers' 3-D expert parameters whose experts' matrices are all in blocks (``gguf_weights.expert_name``):
    ``model.layers.N.mlp.experts.gate_up_proj`` (gate and up) and ``down_proj``."""
    covered = set()
    for parsed in filter(None, map(parse_expert_name, quantized)):
        layer, _, projection = parsed
        part = "down_proj" if projection == "down_proj" else "gate_up_proj"
        covered.add(f"model.layers.{layer}.{arch.mlp}.experts.{part}")
    return covered


def _stacked_in_blocks(quantized: dict[str, QuantizedWeight], arch: Architecture) -> set[str]:
    """transformers' stacked gate-and-up parameters (``Architecture.stacked_mlp``) whose halves are both in blocks."""
    if not arch.stacked_mlp:
        return set()
    own = arch.stacked_mlp.rpartition(".")[0]
    layers = {name.split(".")[2] for name in quantized if name.endswith(f".{own}.gate_proj.weight")}
    return {
        f"model.layers.{layer}.{arch.stacked_mlp}.weight"
        for layer in layers
        if f"model.layers.{layer}.{own}.up_proj.weight" in quantized
    }


def _half(name: str, arch: Architecture) -> tuple[str, str] | None:
    """A gate's or up's matrix (llama's name) that transformers holds in one stacked parameter
    (``Architecture.stacked_mlp``): that parameter's name and the half ("0": the gate's, "1": the up's); else None."""
    parts = name.split(".")
    own = arch.stacked_mlp.rpartition(".")[0]
    if not arch.stacked_mlp or len(parts) != 6 or parts[3] != own or parts[4] not in ("gate_proj", "up_proj"):
        return None
    return f"model.layers.{parts[2]}.{arch.stacked_mlp}.weight", "0" if parts[4] == "gate_proj" else "1"


def _rope_factors(model: PreTrainedModel, reader: GGUFFile) -> None:
    """Llama 3.1+ files carry their RoPE scaling as a tensor of per-frequency divisors (``rope_freqs.weight``, which
    llama.cpp's converter computes from the checkpoint's ``rope_scaling``), not as keys: divide RoPE's frequencies
    by them, as llama.cpp does (transformers' reading of the file leaves them out)."""
    tensor = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if tensor is None or ARCHITECTURES[architecture(reader)].value_norm:  # (Gemma 4's: its config's proportional RoPE)
        return
    rotary = model.model.rotary_emb
    factors = torch.from_numpy(np.array(tensor.data, dtype=np.float32)).reshape(rotary.inv_freq.shape)
    rotary.inv_freq = rotary.inv_freq / factors
    rotary.original_inv_freq = rotary.inv_freq


def densify(model: PreTrainedModel, quantized: dict[str, QuantizedWeight], names: list[str] | None = None) -> None:
    """Write the dense values of the matrices ``names`` (all the quantized ones when None) into ``model``, as the
    native dequantizer computes them from the blocks (GGUF's own ``d * q (+ m)``)."""
    parameters = dict(model.named_parameters(remove_duplicate=False))
    arch = by_model_type(model.config.model_type)
    assert arch is not None
    done: set[int] = set()  # a tied output layer is the embedding's matrix: dequantized once
    for name in quantized if names is None else names:
        weight = quantized[name]
        half = _half(name, arch)
        if id(weight) in done or (name not in parameters and half is None):  # an expert's: read from its blocks
            continue
        done.add(id(weight))
        target = parameters[name].data if half is None else _place(parameters[half[0]].data, half[1], arch)
        rows = torch.arange(weight.out_features)
        with torch.inference_mode():
            target.copy_(weight.pack().rows(rows, target.dtype))


def densify_all(model: PreTrainedModel, quantized: dict[str, QuantizedWeight]) -> None:
    """Every matrix's dense values written into ``model`` (``--quantization none`` of a file served from its blocks),
    each expert's into its rows of transformers' 3-D parameters, by gguf-py's dequantizer (no native kernel needed)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    parameters = dict(model.named_parameters(remove_duplicate=False))
    arch = by_model_type(model.config.model_type)
    assert arch is not None
    with torch.no_grad():
        for name, weight in quantized.items():
            rows = dequantize(weight.data.numpy(), GGMLQuantizationType(weight.qtype))
            values = torch.from_numpy(np.ascontiguousarray(rows).reshape(weight.out_features, weight.in_features))
            _dense_target(parameters, name, arch).copy_(values)


def _dense_target(parameters: dict[str, torch.nn.Parameter], name: str, arch: Architecture) -> torch.Tensor:
    """Where a quantized matrix's values go: its parameter, or an expert's rows of a 3-D one."""
    half = _half(name, arch)
    if half is not None:
        return _place(parameters[half[0]].data, half[1], arch)
    parsed = parse_expert_name(name)
    if parsed is None:
        return parameters[name].data
    layer, expert, projection = parsed
    prefix = f"model.layers.{layer}.{arch.mlp}.experts."
    if projection == "down_proj":
        return _place(parameters[prefix + "down_proj"].data, "", arch)[expert]
    return _place(parameters[prefix + "gate_up_proj"].data, "0" if projection == "gate_proj" else "1", arch)[expert]


def _place(parameter: torch.Tensor, part: str, arch: Architecture) -> torch.Tensor:
    """The view of a parameter that a file's tensor fills: the whole of it, or (``part`` "0" or "1") the gate's or
    the up's half of a mixture's ``gate_up_proj`` (and of gpt-oss's ``gate_up_proj_bias``), or of a stacked MLP's
    matrix (``Architecture.stacked_mlp``). The file holds each
    expert's matrix ``[out, in]``; gpt-oss's transformers model holds them ``[in, out]``, gate and up columns
    interleaved."""
    if not arch.oai_experts:
        return parameter if not part else parameter.chunk(2, dim=-2)[int(part)]  # (the rows: [.., out, in])
    view = parameter if not part else parameter[..., int(part) :: 2]
    return view.transpose(-1, -2) if view.dim() == 3 else view


def _dense_tensors(reader: GGUFFile, config: PretrainedConfig, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, values)`` for every tensor of the file that is not in ``skip``, dequantized by gguf's reader."""
    from gguf.quants import dequantize

    permuted = permuted_qk(reader)
    arch = ARCHITECTURES[architecture(reader)]
    for tensor in reader.tensors:
        kind = tensor.name.split(".")[2] if tensor.name.startswith("blk.") else ""
        if kind in EXPERT_PROJECTIONS and tensor.tensor_type.name in SUPPORTED:
            continue  # in blocks (``gguf_weights.read``)
        if tensor.name.endswith(".ssm_ba.weight"):  # Qwen3-Next's beta and alpha rows in one tensor
            yield from _beta_alpha(tensor, reader, skip)
            continue
        name = _name(tensor.name, arch)
        if name is None and tensor.name not in _READ_ELSEWHERE:
            raise NotServedNatively(f"this {arch.gguf} file's tensor {tensor.name} is not read by the native path")
        if name is None or name in skip:
            continue
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF lists dimensions innermost first
        values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
        if tensor.name.endswith("norm.weight") and ".ssm_norm." not in tensor.name:  # offset + w in the file
            values = values - np.float32(arch.norm_offset)  # (Qwen3.5's gated norm multiplies by w: stored so)
        if tensor.name.endswith(".ssm_a"):  # the converter writes Qwen3.5's -exp(A_log)
            values = np.log(-values)
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = (
                config.num_attention_heads if ".attn_q." in tensor.name else config_value(config, "num_key_value_heads")
            )
            values = unpermute_rows(values, heads)
        yield name, torch.from_numpy(np.array(values, copy=True, order="C"))


def _beta_alpha(tensor: Any, reader: GGUFFile, skip: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Qwen3-Next's ``ssm_ba`` of a dense type, dequantized, as Qwen3.5's beta and alpha matrices."""
    from gguf.quants import dequantize

    shape = tuple(int(d) for d in reversed(tensor.shape))
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    for name, rows in split_beta_alpha(tensor.name, values, reader):
        if name not in skip:
            yield name, torch.from_numpy(np.array(rows, copy=True, order="C"))


#: Qwen3.5's linear attention's other tensors (``blk.N.<name>...``): transformers' parameter in ``linear_attn``.
_DELTA_PARAMETERS = {"ssm_a": "A_log", "ssm_dt": "dt_bias", "ssm_conv1d": "conv1d.weight", "ssm_norm": "norm.weight"}
#: ... Granite 4.0-H's Mamba-2 layers' (``blk.N.<name>[.weight|.bias]``): transformers' parameter in ``mamba``
#: (``{}``: the tensor's own suffix: the convolution's weight and bias).
_MAMBA_PARAMETERS = {"ssm_a": "A_log", "ssm_d": "D", "ssm_dt": "dt_bias", "ssm_conv1d": "conv1d.{}",
                     "ssm_norm": "norm.weight"}  # fmt: skip
#: A dense expert tensor's place in transformers' 3-D parameters: ``name:part`` (the gate's half, the up's).
_DENSE_EXPERTS = {"ffn_gate_exps": "gate_up_proj:0", "ffn_up_exps": "gate_up_proj:1", "ffn_down_exps": "down_proj"}


def _name(gguf_name: str, arch: Architecture) -> str | None:
    if gguf_name in ("output_norm.weight", "token_embd_norm.weight"):  # LFM2's converter names its final norm so
        return arch.name("model.norm") + ".weight"
    if gguf_name == "per_layer_proj_norm.weight":  # Gemma 4's per-layer inputs' norm
        return "model.per_layer_projection_norm.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[2] in _DENSE_EXPERTS:  # gpt-oss's experts' biases too
        place = _DENSE_EXPERTS[parts[2]]
        place = place.replace("_proj", "_proj_bias") if parts[3] == "bias" else place
        return f"model.layers.{parts[1]}.{arch.mlp}.experts.{place}"
    if len(parts) >= 3 and parts[0] == "blk" and arch.mamba and parts[2] in _MAMBA_PARAMETERS:  # Granite 4.0-H's
        return f"model.layers.{parts[1]}.mamba.{_MAMBA_PARAMETERS[parts[2]].format(parts[-1])}"
    if len(parts) >= 3 and parts[0] == "blk" and parts[2] in _DELTA_PARAMETERS:  # Qwen3.5's linear attention's
        return f"model.layers.{parts[1]}.linear_attn.{_DELTA_PARAMETERS[parts[2]]}"
    halves = ("ffn_gate", "ffn_up", "ffn_gate_shexp", "ffn_up_shexp")
    if len(parts) == 4 and arch.stacked_mlp and parts[2] in halves:  # a half of a stacked matrix
        return f"model.layers.{parts[1]}.{arch.stacked_mlp}.weight:{0 if parts[2].startswith('ffn_gate') else 1}"
    norms = _OUTPUT_NORMS if arch.output_norms else _NORMS
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in norms:
        return f"model.layers.{parts[1]}.{arch.name(norms[parts[2]])}.weight"
    return hf_name(gguf_name, arch)
