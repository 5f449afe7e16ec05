"""A GGUF's model config from its own keys (``<arch>.*``, the tokenizer's special ids, whether the output layer is
the embedding's), and the refusal of files this server does not serve natively."""

from __future__ import annotations

from typing import TYPE_CHECKING

from transformers import PretrainedConfig

from engine.core.architectures import ARCHITECTURES, NotServedNatively, names
from engine.runtime.gguf_weights import architecture
from engine.runtime.quantized_weights import SUPPORTED

if TYPE_CHECKING:
    from engine.runtime.gguf_file import GGUFFile


def check(reader: GGUFFile) -> None:
    """Refuses a file whose architecture is not served natively, or that holds a tensor of a type the native
    kernels do not read (nor F32/F16/BF16, served dense), naming it and those that are."""
    arch = architecture(reader)
    if arch not in ARCHITECTURES:
        raise NotServedNatively(
            f"GGUF architecture {arch!r} is not served natively (served: {names()}); "
            "--quantization none serves it through transformers"
        )
    unread = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED) - {"F32", "F16", "BF16"})
    if unread:
        raise NotServedNatively(
            f"GGUF tensor type {', '.join(unread)} is not read by the native kernels (read: "
            f"{', '.join(SUPPORTED)}, and F32/F16/BF16 served dense); --quantization none serves the file through "
            "transformers, dense"
        )


#: transformers' config fields from the file's ``<arch>.*`` keys.
_FIELDS = {
    "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size", "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
    "context_length": "max_position_embeddings", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.key_length": "head_dim",  # Qwen3's heads are not hidden / heads wide
    "expert_count": "num_experts", "expert_used_count": "num_experts_per_tok",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
}  # fmt: skip
#: ... and from its tokenizer's keys.
_TOKENS = {
    "tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.padding_token_id": "pad_token_id", "tokenizer.ggml.unknown_token_id": "unk_token_id",
}  # fmt: skip


def config_of(reader: GGUFFile) -> PretrainedConfig:
    """transformers' config of a natively served file (refusing any other), from its keys alone: transformers' own
    reading of the file takes ~7 s on a Qwen file, most of it building a vocabulary it does not use for this, and
    leaves out the head size, Llama 3's RoPE factors and the like."""
    from transformers import AutoConfig

    check(reader)
    arch = architecture(reader)
    keys = reader.keys
    values = {field: keys[f"{arch}.{key}"] for key, field in _FIELDS.items() if f"{arch}.{key}" in keys}
    values.update({field: keys[key] for key, field in _TOKENS.items() if key in keys})
    embedding = next(tensor for tensor in reader.tensors if tensor.name == "token_embd.weight")
    values["vocab_size"] = int(keys.get(f"{arch}.vocab_size", embedding.shape[1]))
    values["tie_word_embeddings"] = not any(tensor.name == "output.weight" for tensor in reader.tensors)
    row = ARCHITECTURES[arch]
    for key, field in _RENAMED.get(arch, {}).items():
        if key in values:
            values[field] = values.pop(key)
    rope = _rope(reader)
    values["rope_parameters"] = rope
    if row.sliding_window_pattern:
        values.update(_local_layers(reader))
    if arch == "gemma3":
        values.update(_gemma3(reader, rope, values))
    if arch == "phi3":
        values.update(_phi3(reader, rope, values))
    if row.value_norm:
        values.update(_gemma4(reader, rope, values))
    if row.short_conv:
        values.update(_lfm2(reader, values))
    if row.delta_net:
        values.update(_qwen35(reader, values, rope))
    if row.mamba:
        values.update(_granitehybrid(reader, values))
    if row.nope_period:  # which layers rotate (1) and which do not (0), as llama.cpp's graph takes them
        period = row.nope_period
        values["no_rope_layers"] = [int((i + 1) % period != 0) for i in range(values["num_hidden_layers"])]
    if row.multipliers:
        values.update({field: float(keys[f"{arch}.{k}"]) for k, field in _MULTIPLIERS.items() if f"{arch}.{k}" in keys})
    if row.experts and not row.top_k_softmax:  # the chosen weights as llama.cpp's graph of the family takes them
        values.update(norm_topk_prob=row.renormalized_experts, decoder_sparse_step=1, mlp_only_layers=[])
    return AutoConfig.for_model(row.model_type, **values)


#: transformers' names of a family's fields where they are not the others' (``_FIELDS``).
_RENAMED = {
    "gpt-oss": {"num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"},
    "granitemoe": {"num_experts": "num_local_experts", "moe_intermediate_size": "intermediate_size"},
}
#: Granite's multipliers (``Architecture.multipliers``): the file's keys, transformers' fields.
_MULTIPLIERS = {
    "embedding_scale": "embedding_multiplier", "attention.scale": "attention_multiplier",
    "residual_scale": "residual_multiplier", "logit_scale": "logits_scaling",
}  # fmt: skip


def _lfm2(reader: GGUFFile, values: dict) -> dict:
    """LFM2's layers as its converter writes them: a KV head count per layer, 0 in a convolution layer; the
    convolution's span (``shortconv.l_cache``); its norms' epsilon under its own name; the MLP's size as the file
    gives it (already adjusted)."""
    keys = reader.keys
    heads = values.pop("num_key_value_heads")
    heads = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * values["num_hidden_layers"]
    return {
        "num_key_value_heads": max(heads), "norm_eps": values.pop("rms_norm_eps"),
        "layer_types": ["full_attention" if h else "conv" for h in heads],
        "conv_L_cache": int(keys["lfm2.shortconv.l_cache"]), "block_auto_adjust_ff_dim": False,
    }  # fmt: skip


def _qwen35(reader: GGUFFile, values: dict, rope: dict) -> dict:
    """Qwen3.5's linear-attention layers (``attention.recurrent_layers``, else every layer but each
    ``full_attention_interval``-th), their shapes (``ssm.*``), the rotated part of each head (``rope.dimension_count``;
    its text positions turn every section alike, as plain RoPE), and the value heads in the converter's tiled order."""
    arch = architecture(reader)
    keys = reader.keys
    layers = values["num_hidden_layers"]
    recurrent = keys.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        interval = int(keys.get(f"{arch}.full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    head_dim = values.get("head_dim") or values["hidden_size"] // values["num_attention_heads"]
    value_heads = int(keys[f"{arch}.ssm.time_step_rank"])
    return {
        "layer_types": ["linear_attention" if flag else "full_attention" for flag in list(recurrent)[:layers]],
        "linear_conv_kernel_dim": int(keys[f"{arch}.ssm.conv_kernel"]),
        "linear_key_head_dim": int(keys[f"{arch}.ssm.state_size"]),
        "linear_num_key_heads": int(keys[f"{arch}.ssm.group_count"]),
        "linear_num_value_heads": value_heads,
        "linear_value_head_dim": int(keys[f"{arch}.ssm.inner_size"]) // value_heads,
        "rope_parameters": {**rope, "partial_rotary_factor": int(keys.get(f"{arch}.rope.dimension_count", head_dim))
                            / head_dim},
        "linear_v_tiled": arch != "qwen3next",  # (Qwen3-Next's converter keeps transformers' grouped order)
    }  # fmt: skip


def _granitehybrid(reader: GGUFFile, values: dict) -> dict:
    """Granite 4.0-H's layers as its converter writes them: a KV head count per layer, 0 in a Mamba-2 layer; the
    Mamba-2 shapes (``ssm.*``: the heads are ``time_step_rank``); RoPE only where ``rope.scaling.finetuned`` says
    so (Granite 4.0-H's attention has none; llama.cpp's default is RoPE); its MLP dense, or (Tiny, Small) beside a
    mixture of experts (``feed_forward_length`` their width, ``expert_shared_feed_forward_length`` the MLP's)."""
    arch, keys = architecture(reader), reader.keys
    heads = values.pop("num_key_value_heads")
    heads = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * values["num_hidden_layers"]
    inner, ssm_heads = int(keys[f"{arch}.ssm.inner_size"]), int(keys[f"{arch}.ssm.time_step_rank"])
    experts, used = int(values.pop("num_experts", 0) or 0), int(values.pop("num_experts_per_tok", 0) or 0)
    shared = int(keys.get(f"{arch}.expert_shared_feed_forward_length", 0)) if experts else values["intermediate_size"]
    values.pop("shared_expert_intermediate_size", None)
    return {
        "num_key_value_heads": max(heads), "shared_intermediate_size": shared, "num_local_experts": experts,
        "num_experts_per_tok": used, "layer_types": ["full_attention" if h else "linear_attention" for h in heads],
        "mamba_n_heads": ssm_heads, "mamba_d_head": inner // ssm_heads, "mamba_expand": inner // values["hidden_size"],
        "mamba_d_state": int(keys[f"{arch}.ssm.state_size"]), "mamba_n_groups": int(keys[f"{arch}.ssm.group_count"]),
        "mamba_d_conv": int(keys[f"{arch}.ssm.conv_kernel"]), "mamba_proj_bias": False,
        "mamba_conv_bias": any(t.name.endswith(".ssm_conv1d.bias") for t in reader.tensors),
        "position_embedding_type": "rope" if keys.get(f"{arch}.rope.scaling.finetuned", True) else None,
    }  # fmt: skip


def _rope(reader: GGUFFile) -> dict:
    """RoPE as the file's keys give it: its base, and a linear or YaRN scaling (YaRN's correction range truncated to
    whole dims, as ggml's ``ggml_rope_yarn_corr_dims`` and transformers' default take it)."""
    arch, keys = architecture(reader), reader.keys
    rope = {"rope_type": "default", "rope_theta": float(keys.get(f"{arch}.rope.freq_base", 10000.0))}
    scaling = keys.get(f"{arch}.rope.scaling.type")
    if scaling in ("linear", "yarn"):
        rope.update(rope_type=scaling, factor=float(keys[f"{arch}.rope.scaling.factor"]))
    if scaling == "yarn":
        rope["original_max_position_embeddings"] = int(keys[f"{arch}.rope.scaling.original_context_length"])
        for key, field in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in keys:
                rope[field] = float(keys[f"{arch}.rope.scaling.{key}"])
    return rope


def _phi3(reader: GGUFFile, rope: dict, values: dict) -> dict:
    """Phi-3's LongRoPE (its per-frequency factors as the tensors ``rope_factors_long``/``_short``, the pretraining
    context and attention factor as keys; ``rope`` the file's plain RoPE) and its sliding window (every layer;
    absent, 0 or the whole context: none). A rotation of part of each head (Phi-4-mini) is refused: the native
    RoPE turns whole heads."""
    keys = reader.keys
    head_dim = values["hidden_size"] // values["num_attention_heads"]
    rotated = int(keys.get("phi3.rope.dimension_count", head_dim))
    if rotated != head_dim:
        raise NotServedNatively(
            f"this phi3 file rotates {rotated} of each head's {head_dim} dims (partial RoPE), which the native path "
            "does not; --quantization none serves it through transformers"
        )
    factors = {t.name: [float(x) for x in t.data] for t in reader.tensors if t.name.startswith("rope_factors_")}
    original = int(keys.get("phi3.rope.scaling.original_context_length", values["max_position_embeddings"]))
    extra: dict = {"original_max_position_embeddings": original}
    if factors:
        extra["rope_parameters"] = {
            **rope, "rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
            "short_factor": factors["rope_factors_short.weight"], "original_max_position_embeddings": original,
        }  # fmt: skip
        if "phi3.rope.scaling.attn_factor" in keys:
            extra["rope_parameters"]["attention_factor"] = float(keys["phi3.rope.scaling.attn_factor"])
    window = int(keys.get("phi3.attention.sliding_window", 0))
    extra["sliding_window"] = window if 0 < window < values["max_position_embeddings"] else None
    return extra


def _gemma4(reader: GGUFFile, rope: dict, values: dict) -> dict:
    """Gemma 4's layers as its converter writes them: the global layers' head size (``attention.key_length``) beside
    the local ones' (``key_length_swa``), a KV head count and an MLP width per layer where they differ (the global
    layers' fewer KV heads, their keys as values; the KV-sharing layers' double-wide MLP), the last
    ``shared_kv_layers`` layers reading earlier layers' KV, the per-layer inputs' width; each kind's RoPE: the global
    one proportional, the part of each head it turns given by ``rope_freqs`` (a factor of 1 where it turns, 1e30
    where it does not), the local one plain with its own base."""
    arch, keys = architecture(reader), reader.keys
    if int(keys.get(f"{arch}.expert_count", 0) or 0):
        raise NotServedNatively("this gemma4 file has a mixture of experts beside its MLP (26B-A4B), which the native "
                                "path does not serve; its dense sizes (E2B, E4B, 31B) are served")  # fmt: skip
    layers, local = values["num_hidden_layers"], [kind == "sliding_attention" for kind in values["layer_types"]]
    global_dim, local_dim = int(keys[f"{arch}.attention.key_length"]), int(keys[f"{arch}.attention.key_length_swa"])
    heads, widths = values.pop("num_key_value_heads"), values.pop("intermediate_size")
    heads = [int(h) for h in heads] if isinstance(heads, list) else [int(heads)] * layers
    widths = [int(w) for w in widths] if isinstance(widths, list) else [int(widths)] * layers
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    shared = int(keys.get(f"{arch}.attention.shared_kv_layers", 0))
    keys_as_values = not any(f"blk.{i}.attn_v.weight" in tensors for i in range(layers - shared) if not local[i])
    local_heads = next((h for h, flag in zip(heads, local, strict=True) if flag), heads[0])
    global_heads = next((h for h, flag in zip(heads, local, strict=True) if not flag), local_heads)
    if global_heads != local_heads and not keys_as_values:  # (transformers' config ties the two)
        raise NotServedNatively("this gemma4 file's global layers have their own KV heads but keys apart from values")
    if int(keys.get(f"{arch}.rope.dimension_count_swa", local_dim)) != local_dim:
        raise NotServedNatively(
            "this gemma4 file's local layers rotate part of each head, which the native path does not"
        )
    factors, per_layer = tensors.get("rope_freqs.weight"), tensors.get("per_layer_token_embd.weight")
    turned = global_dim if factors is None else 2 * sum(float(f) == 1.0 for f in factors.data)
    return {
        "head_dim": local_dim, "global_head_dim": global_dim, "num_key_value_heads": local_heads,
        "num_global_key_value_heads": global_heads if keys_as_values else None, "attention_k_eq_v": keys_as_values,
        "intermediate_size": min(widths), "use_double_wide_mlp": max(widths) > min(widths),
        "num_kv_shared_layers": shared,
        "hidden_size_per_layer_input": int(keys.get(f"{arch}.embedding_length_per_layer_input", 0)),
        "vocab_size_per_layer_input": values["vocab_size"] if per_layer is None else int(per_layer.shape[1]),
        "final_logit_softcapping": keys.get(f"{arch}.final_logit_softcapping") or None,
        "rope_parameters": {
            "full_attention": {"rope_type": "proportional", "rope_theta": rope["rope_theta"],
                               "partial_rotary_factor": turned / global_dim},
            "sliding_attention": {"rope_type": "default",
                                  "rope_theta": float(keys.get(f"{arch}.rope.freq_base_swa", 10000.0))},
        },
    }  # fmt: skip


def _local_layers(reader: GGUFFile) -> dict:
    """The sliding-window layers as llama.cpp reads them: ``sliding_window`` positions, in the layers the
    ``sliding_window_pattern`` key names (an array of flags or a period; absent: the architecture's period, whose last
    layer is global: Gemma 3's 6, gpt-oss's 2)."""
    arch = architecture(reader)
    keys = reader.keys
    layers = int(keys[f"{arch}.block_count"])
    window = int(keys.get(f"{arch}.attention.sliding_window", 0))
    pattern = keys.get(f"{arch}.attention.sliding_window_pattern", ARCHITECTURES[arch].sliding_window_pattern)
    if isinstance(pattern, list):
        local = [bool(flag) for flag in pattern][:layers]
    else:
        local = [window > 0 and (int(pattern) == 0 or i % int(pattern) < int(pattern) - 1) for i in range(layers)]
    return {
        "sliding_window": window or None,
        "layer_types": ["sliding_attention" if flag else "full_attention" for flag in local],
    }


def _gemma3(reader: GGUFFile, rope: dict, values: dict) -> dict:
    """Gemma 3's local layers' own RoPE base (``rope.freq_base_swa``, else 10,000) without the global layers'
    scaling; the attention scaled by the head size (by hidden / heads in the 62-layer 27B, as llama.cpp does); the
    output's soft cap."""
    keys = reader.keys
    head_dim = values.get("head_dim")
    hidden, heads = values["hidden_size"], values["num_attention_heads"]
    return {
        "rope_parameters": {
            "full_attention": rope,
            "sliding_attention": {
                "rope_type": "default", "rope_theta": float(keys.get("gemma3.rope.freq_base_swa", 10000.0))
            },
        },
        "query_pre_attn_scalar": hidden // heads if values["num_hidden_layers"] == 62 else head_dim or hidden // heads,
        "final_logit_softcapping": keys.get("gemma3.final_logit_softcapping") or None,
    }  # fmt: skip
