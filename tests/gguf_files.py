"""Tiny models of each natively served architecture written as GGUF files the way llama.cpp's converter writes them
(``convert_hf_to_gguf.py``: its key names, tensor names, llama's permuted query/key rows, F32 norms and biases),
with the bundled SmolLM2 file's tokenizer, and their matrices in any type gguf-py quantizes."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
    GptOssConfig,
    GptOssForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    GraniteMoeConfig,
    GraniteMoeForCausalLM,
    GraniteMoeHybridConfig,
    GraniteMoeHybridForCausalLM,
    Lfm2Config,
    Lfm2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    OlmoeConfig,
    OlmoeForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3_5ForCausalLM,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeTextConfig,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
    SmolLM3Config,
    SmolLM3ForCausalLM,
)  # fmt: skip

_MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
           "qwen3": (Qwen3Config, Qwen3ForCausalLM), "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
           "phi3": (Phi3Config, Phi3ForCausalLM), "qwen3moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
           "olmoe": (OlmoeConfig, OlmoeForCausalLM), "qwen2moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
           "gpt-oss": (GptOssConfig, GptOssForCausalLM), "granite": (GraniteConfig, GraniteForCausalLM),
           "granitemoe": (GraniteMoeConfig, GraniteMoeForCausalLM), "lfm2": (Lfm2Config, Lfm2ForCausalLM),
           "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
           "granitehybrid": (GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM),
           "qwen35": (Qwen3_5TextConfig, Qwen3_5ForCausalLM),
           "qwen35moe": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
           "qwen3next": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM),
           "gemma4": (Gemma4TextConfig, Gemma4ForCausalLM)}  # fmt: skip
_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}  # fmt: skip
#: The mixtures of experts among the tiny models.
MIXTURES = ("qwen3moe", "olmoe", "qwen2moe", "gpt-oss", "granitemoe", "qwen35moe", "qwen3next")
#: Qwen3.5's families: its linear attention, dense or with a mixture of experts.
QWEN35 = ("qwen35", "qwen35moe", "qwen3next")
#: The architectures whose converter permutes the query's and key's rows (llama.cpp's ``LlamaModel`` and its heirs).
PERMUTED = ("llama", "granite", "granitemoe", "smollm3", "granitehybrid")
#: Granite's multipliers in the tiny models: far enough from 1 (and from 1/sqrt(head size)) that each counts.
GRANITE_MULTIPLIERS = {"embedding_multiplier": 3.0, "attention_multiplier": 0.3, "residual_multiplier": 0.5,
                       "logits_scaling": 4.0}  # fmt: skip
#: A mixture of experts in the tiny models: 8 experts of 64 rows, 2 a row (Qwen3-30B-A3B: 128 of 768, 8 a row).
TINY_EXPERTS = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True}
#: Gemma 3's four norms a layer, as its converter names them.
_GEMMA_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}  # fmt: skip
#: Gemma 4's: Gemma 3's, and each layer's per-layer input's gate, projection and norm.
_GEMMA4_LAYER = {**_GEMMA_LAYER, "per_layer_input_gate": "inp_gate", "per_layer_projection": "proj",
                 "post_per_layer_input_norm": "post_norm"}  # fmt: skip
#: ... and the model's.
_GEMMA4_MODEL = {"model.embed_tokens_per_layer.weight": "per_layer_token_embd.weight",
                 "model.per_layer_model_projection.weight": "per_layer_model_proj.weight",
                 "model.per_layer_projection_norm.weight": "per_layer_proj_norm.weight"}  # fmt: skip
#: Gemma 4 in the tiny model (as E2B, smaller): three local layers, a global one, then a local and a global one that
#: read the KV of the last of their kind before them (with a double-wide MLP; the last layer that writes KV is a
#: global one, the one before it local, as in E2B and as llama.cpp assumes); the global heads twice as wide, one KV
#: head (the keys as the values) where the local layers have two; per-layer inputs 32 wide; the output soft-capped.
GEMMA4_LAYERS = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]
GEMMA4 = {"layer_types": GEMMA4_LAYERS, "num_hidden_layers": 6, "head_dim": 32, "global_head_dim": 64,
          "num_global_key_value_heads": 1, "attention_k_eq_v": True, "num_kv_shared_layers": 2,
          "use_double_wide_mlp": True, "hidden_size_per_layer_input": 32, "final_logit_softcapping": 30.0,
          "tie_word_embeddings": True, "pad_token_id": None,
          "rope_parameters": {"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                 "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}  # fmt: skip
#: Phi-3's fused projections.
_PHI3_LAYER = {**_LAYER, "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up"}
#: gpt-oss's router, sinks and MLP input norm.
_OAI_LAYER = {**_LAYER, "mlp.router": "ffn_gate_inp", "post_attention_layernorm": "post_attention_norm"}
#: granitemoe's router.
_GRANITE_MOE_LAYER = {**_LAYER, "block_sparse_moe.router": "ffn_gate_inp"}
#: LFM2's modules, as its converter names them (its final norm is ``token_embd_norm``).
_LFM2_LAYER = {**_LAYER, "operator_norm": "attn_norm", "ffn_norm": "ffn_norm", "feed_forward.w1": "ffn_gate",
               "feed_forward.w3": "ffn_up", "feed_forward.w2": "ffn_down", "self_attn.out_proj": "attn_output",
               "self_attn.q_layernorm": "attn_q_norm", "self_attn.k_layernorm": "attn_k_norm",
               "conv.in_proj": "shortconv.in_proj", "conv.out_proj": "shortconv.out_proj",
               "conv.conv": "shortconv.conv"}  # fmt: skip
#: Qwen3.5's modules, as its converter names them (the MLP's input norm is ``post_attention_norm``).
_QWEN35_LAYER = {**_LAYER, "post_attention_layernorm": "post_attention_norm", "linear_attn.in_proj_qkv": "attn_qkv",
                 "linear_attn.in_proj_z": "attn_gate", "linear_attn.in_proj_b": "ssm_beta",
                 "linear_attn.in_proj_a": "ssm_alpha", "linear_attn.out_proj": "ssm_out",
                 "linear_attn.conv1d": "ssm_conv1d", "linear_attn.norm": "ssm_norm"}  # fmt: skip
#: Qwen3.5's linear attention in the tiny model: 2 key heads, 4 value heads (the converter tiles them), keys and
#: values of one size (llama.cpp's graph reads them so); a quarter of each attention head rotated.
QWEN35_LINEAR = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
                 "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4}  # fmt: skip
#: LFM2's layers in the tiny model: convolutions first and last, as LFM2-1.2B's (10 of its 16 layers).
LFM2_LAYERS = ["conv", "conv", "full_attention", "conv"]
#: Granite 4.0-H's layers in the tiny model: Mamba-2 first and last (Micro: 36 of its 40), attention without RoPE.
GRANITE_HYBRID_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
#: ... and its Mamba-2 shapes: 8 heads of 32 (twice the hidden size, as released), B and C of 16 in 2 groups.
GRANITE_MAMBA = {"mamba_n_heads": 8, "mamba_d_head": 32, "mamba_d_state": 16, "mamba_n_groups": 2, "mamba_d_conv": 4,
                 "mamba_expand": 2, "mamba_conv_bias": True, "mamba_proj_bias": False}  # fmt: skip
#: Granite 4.0-H's modules, as its converter names them.
_GRANITE_HYBRID_LAYER = {**_LAYER, "mamba.in_proj": "ssm_in", "mamba.out_proj": "ssm_out",
                         "block_sparse_moe.router": "ffn_gate_inp"}  # fmt: skip
#: gpt-oss's window in the tiny model (every other layer, from the first): short, so that a prompt slides past it.
OAI_WINDOW = 12
#: gpt-oss's YaRN as its config gives it, its pretraining context shortened to the tiny model's, and the
#: correction range truncated to whole dims as llama.cpp's ggml computes it.
OAI_ROPE = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 32}  # fmt: skip
#: Gemma 3's local layers' window in the tiny model: short, so that a test's prompt slides past it.
GEMMA_WINDOW = 8
#: Phi-3's window (every layer) in the tiny model.
PHI3_WINDOW = 24


#: Llama 3.1's RoPE scaling, its context shortened to the tiny model's (so that every kind of frequency occurs).
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip


def tiny_model(
    arch: str, vocab: int, seed: int = 0, long_rope: bool = False, positions: int = 1024, mixture: bool = False
) -> PreTrainedModel:
    """A 2-layer model of ``arch`` with random weights; biases and norms random too, so that each counts.
    ``long_rope``: the architecture's long-context RoPE (llama: Llama 3.1's, phi3: LongRoPE), over 64 positions;
    ``positions``: its context length; ``mixture``: Granite 4.0-H's mixture of experts beside its MLP (Tiny's)."""
    config_class, model_class = _MODELS[arch]
    extra: dict = {"head_dim": 48} if arch in ("qwen3", "qwen3moe") else {}  # the file's key_length is read
    if arch in ("granite", "granitemoe", "granitehybrid"):
        extra.update(GRANITE_MULTIPLIERS)
    if arch == "granitemoe":  # 8 experts of 64 rows, 2 a row (granite-3.0-1b-a400m: 32 of 512, 8 a row)
        extra.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64)
    elif arch in MIXTURES and arch != "gpt-oss":  # olmoe, qwen2moe: the chosen experts' weights as they come
        extra.update(TINY_EXPERTS, norm_topk_prob=arch == "qwen3moe")
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):
        extra.update(shared_expert_intermediate_size=96)
    extra["rope_parameters"] = LLAMA3_ROPE if long_rope else {"rope_type": "default", "rope_theta": 1e6}
    extra.update(num_hidden_layers=2, tie_word_embeddings=False)
    if arch == "phi3":
        extra.update(sliding_window=PHI3_WINDOW, original_max_position_embeddings=64 if long_rope else 1024)
        if long_rope:  # factors of 1 to 4 per frequency, as Phi-3.5's config lists them
            factors = torch.linspace(1.0, 4.0, 16, dtype=torch.float64)
            extra["rope_parameters"] = {
                "rope_type": "longrope", "rope_theta": 1e4, "original_max_position_embeddings": 64,
                "long_factor": factors.tolist(), "short_factor": factors.sqrt().tolist(),
            }  # fmt: skip
    if arch == "gpt-oss":  # 8 experts of 64 rows (the whole MLP's size in its config), 2 a row; 4 layers
        extra.update(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=64,
            head_dim=32,
            sliding_window=OAI_WINDOW,
            rope_parameters=OAI_ROPE,
            num_hidden_layers=4,
            layer_types=None,
        )
    if arch == "gemma3":  # six layers: five local ones, then a global one, as llama.cpp reads a file without a pattern
        bases = {"full_attention": 1e6, "sliding_attention": 1e4}
        extra.update(
            head_dim=48, query_pre_attn_scalar=48, sliding_window=GEMMA_WINDOW, num_hidden_layers=6,
            tie_word_embeddings=True,
            rope_parameters={kind: {"rope_type": "default", "rope_theta": base} for kind, base in bases.items()},
        )  # fmt: skip
    if arch == "gemma4":
        extra.update(GEMMA4, sliding_window=GEMMA_WINDOW, vocab_size_per_layer_input=vocab)
    if arch in QWEN35:  # three linear-attention layers, then a full one
        rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}
        extra.update(QWEN35_LINEAR, num_hidden_layers=4, head_dim=32, pad_token_id=None, rope_parameters=rope)
    if arch == "smollm3":  # four layers: the fourth without RoPE (its padding id is beyond the tiny vocabulary)
        extra.update(num_hidden_layers=4, pad_token_id=None)
    if arch == "lfm2":  # the MLP's size as given (the file's is adjusted already); a span of 3, as released
        extra.update(layer_types=LFM2_LAYERS, num_hidden_layers=4, block_auto_adjust_ff_dim=False, conv_L_cache=3,
                     norm_eps=1e-6)  # fmt: skip
    if arch == "granitehybrid":  # dense (its MLP the shared one), NoPE attention, as Granite 4.0-H Micro
        extra.update(GRANITE_MAMBA, layer_types=GRANITE_HYBRID_LAYERS, num_hidden_layers=4, num_local_experts=0,
                     num_experts_per_tok=0, shared_intermediate_size=256, position_embedding_type=None)  # fmt: skip
        if mixture:  # Tiny's: 8 experts of 64 rows, 2 a row, beside the MLP (its 64 of 512, 6 a row)
            extra.update(num_local_experts=8, num_experts_per_tok=2, intermediate_size=64, shared_intermediate_size=96)
    extra.setdefault("intermediate_size", 256)
    config = config_class(
        vocab_size=vocab, hidden_size=128, num_attention_heads=4,
        num_key_value_heads=4 if arch == "olmoe" else 2,  # OLMoE's keys are as many as its queries (llama.cpp's too)
        max_position_embeddings=positions, rms_norm_eps=1e-6, **extra,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("gate_up_proj_bias"):  # gpt-oss: past its SwiGLU's clamp at 7 often enough to count
                parameter.normal_(0, 5.0)
            elif name.endswith("bias"):
                parameter.normal_(0, 0.5)
            elif "norm" in name:
                parameter.uniform_(0.5, 1.5)
            else:
                parameter.normal_(0, 0.08)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's: each layer's own, so that each counts
                buffer.uniform_(0.5, 1.5)
    return model


def write_gguf(
    model: PreTrainedModel,
    arch: str,
    path: Path,
    tokenizer_from: Path | TokenizerKeys,
    types: dict[str, GGMLQuantizationType],
    renamed: dict[int, str] | None = None,
    template: str | None = None,
) -> PreTrainedModel:
    """``model`` as a GGUF at ``path``: each matrix in ``types[its GGUF name's kind]`` (``attn_q``, ``ffn_down``,
    ``token_embd``, ``output``, ...; F32 where absent), vectors F32; a llama3 RoPE scaling as the converter writes it
    (``rope_freqs.weight``: the frequencies' divisors). The model's matrices are set to their dequantized values, so
    that it is the reference of the file; returned."""
    config = model.config
    writer = GGUFWriter(path, arch)
    rope = config.rope_parameters.get("full_attention", config.rope_parameters)  # gemma3: the global layers'
    if arch in ("gemma3", "phi3", "gpt-oss", "gemma4"):
        writer.add_sliding_window(config.sliding_window)
    if rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch in ("gemma3", "gemma4"):
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "gemma4":
        _gemma4_keys(model, writer)
    if arch == "phi3":
        _phi3_keys(model, writer)
    if arch in QWEN35:
        _qwen35_keys(config, writer, arch)
    if arch == "granitehybrid":
        _granite_hybrid_keys(config, writer)
    if arch in ("granite", "granitemoe", "granitehybrid"):
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)
    if rope.get("rope_type") == "llama3":
        scaled = model.model.rotary_emb.inv_freq
        default = rope["rope_theta"] ** -(torch.arange(scaled.numel()) / scaled.numel())
        writer.add_tensor("rope_freqs.weight", (default / scaled).float().numpy())
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_head_count(config.num_attention_heads)
    if arch != "gemma4":  # (its widths, KV heads and head sizes by layer: ``_gemma4_keys``)
        _shape_keys(config, writer, arch)
    _plain_keys(config, writer, arch, rope)
    keys = tokenizer_from if isinstance(tokenizer_from, list) else tokenizer_keys(tokenizer_from)
    _copy_tokenizer(keys, writer, renamed or {}, template)
    _write_tensors(model, arch, writer, types)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model


def _shape_keys(config: Any, writer: GGUFWriter, arch: str) -> None:
    """The MLP's width, the KV heads and the head size, as most converters write them."""
    writer.add_feed_forward_length(config.intermediate_size)
    if arch in ("lfm2", "granitehybrid"):  # a KV head count per layer, 0 in a recurrent layer
        recurrent = ("conv", "linear_attention")
        writer.add_head_count_kv([0 if k in recurrent else config.num_key_value_heads for k in config.layer_types])
        if arch == "lfm2":
            writer.add_shortconv_l_cache(config.conv_L_cache)
    else:
        writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _plain_keys(config: Any, writer: GGUFWriter, arch: str, rope: dict) -> None:
    """RoPE's base, the norms' epsilon, the experts' counts, the file type."""
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_layer_norm_rms_eps(config.norm_eps if arch == "lfm2" else config.rms_norm_eps)
    if arch in ("qwen2moe", "qwen35moe", "qwen3next"):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if arch in MIXTURES:
        writer.add_expert_count(getattr(config, "num_local_experts", None) or config.num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(config, "moe_intermediate_size", config.intermediate_size))
    writer.add_file_type(1)


def _gemma4_keys(model: PreTrainedModel, writer: GGUFWriter) -> None:
    """What llama.cpp's converter writes for Gemma 4: the global heads' size and the local ones', a KV head count and
    an MLP width per layer, the local layers' flags, the KV-sharing layers, the per-layer inputs' width, the soft
    cap, and the global RoPE's proportion as ``rope_freqs`` (1 where a pair turns, 1e30 where it does not)."""
    config = model.config
    local = [kind == "sliding_attention" for kind in config.layer_types]
    per_layer = config.per_layer_config
    layers = range(config.num_hidden_layers)
    global_dim = per_layer[local.index(False)].head_dim
    writer.add_feed_forward_length([model.model.layers[i].mlp.intermediate_size for i in layers])
    writer.add_head_count_kv([per_layer[i].num_key_value_heads for i in layers])
    writer.add_key_length(global_dim)
    writer.add_value_length(global_dim)
    writer.add_key_length_swa(per_layer[0].head_dim)
    writer.add_value_length_swa(per_layer[0].head_dim)
    writer.add_sliding_window_pattern(local)
    writer.add_shared_kv_layers(config.num_kv_shared_layers)
    writer.add_embedding_length_per_layer_input(config.hidden_size_per_layer_input)
    writer.add_final_logit_softcapping(config.final_logit_softcapping)
    turned = int(global_dim * config.rope_parameters["full_attention"]["partial_rotary_factor"] / 2)
    factors = [1.0] * turned + [1e30] * (global_dim // 2 - turned)
    writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    for i in layers:
        writer.add_tensor(f"blk.{i}.layer_output_scale.weight", model.model.layers[i].layer_scalar.float().numpy())
    rng = np.random.default_rng(0)  # the KV-sharing layers' own keys and values, which released checkpoints keep
    for i in layers[len(layers) - config.num_kv_shared_layers :]:
        dim, heads = per_layer[i].head_dim, per_layer[i].num_key_value_heads
        kinds = ("attn_k",) if config.attention_k_eq_v and not local[i] else ("attn_k", "attn_v")
        for kind in kinds:
            writer.add_tensor(
                f"blk.{i}.{kind}.weight", rng.normal(0, 0.08, (heads * dim, config.hidden_size)).astype(np.float32)
            )
        writer.add_tensor(f"blk.{i}.attn_k_norm.weight", np.ones(dim, dtype=np.float32))


def _write_tensors(
    model: PreTrainedModel, arch: str, writer: GGUFWriter, types: dict[str, GGMLQuantizationType]
) -> None:
    """Every parameter of ``model`` as the file's tensors, each matrix in its kind's type (the model's values set
    to what the file restores)."""
    config = model.config
    mixture = arch == "granitehybrid" and bool(config.num_local_experts)  # its MLP then named a shared expert's
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if arch == "qwen3next" and name.endswith("linear_attn.in_proj_a.weight"):
                continue  # (in ``ssm_ba``, beside beta's rows)
            merged = arch == "qwen3next" and name.endswith("linear_attn.in_proj_b.weight")
            for gguf_name, values, target in (
                _beta_alpha(model, name) if merged else _tensors(name, parameter, arch, mixture)
            ):
                plus_one = arch == "gemma3" or (arch in QWEN35 and ".ssm_norm." not in gguf_name)
                if plus_one and gguf_name.endswith("norm.weight"):  # the model multiplies by 1 + w: the file too
                    values = values + np.float32(1.0)
                kind = gguf_name.split(".")[-2] if gguf_name.startswith("blk.") else gguf_name.split(".")[0]
                matrix = values.ndim >= 2 and gguf_name.endswith(".weight")  # (gpt-oss's experts' biases are 2-D)
                qtype = types.get(kind, GGMLQuantizationType.F32) if matrix else GGMLQuantizationType.F32
                if arch in PERMUTED and kind in ("attn_q", "attn_k"):
                    heads = config.num_attention_heads if kind == "attn_q" else config.num_key_value_heads
                    values = _permute(values, heads)
                if qtype == GGMLQuantizationType.F32:
                    writer.add_tensor(gguf_name, values)
                    continue
                raw = quantize(values, qtype)
                writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
                restored = dequantize(raw, qtype)
                if arch in PERMUTED and kind in ("attn_q", "attn_k"):
                    restored = _unpermute(restored, heads)
                if arch in QWEN35 and arch != "qwen3next":
                    restored = _qwen35_order(kind, restored, config, untile=True)
                target.copy_(torch.from_numpy(np.ascontiguousarray(restored)))


class _BetaAlpha:
    """Qwen3-Next's ``ssm_ba`` as the converter writes it (each key head's value heads' beta rows, then their alpha
    rows), restored into transformers' Qwen3.5 beta and alpha matrices (``copy_``)."""

    def __init__(self, beta: torch.Tensor, alpha: torch.Tensor, key_heads: int) -> None:
        self.beta, self.alpha, self.key_heads = beta, alpha, key_heads

    def merged(self) -> np.ndarray:
        rows = torch.stack([t.reshape(self.key_heads, -1, t.shape[-1]) for t in (self.beta, self.alpha)], dim=1)
        return rows.reshape(-1, self.beta.shape[-1]).float().numpy().copy()

    def copy_(self, values: torch.Tensor) -> None:
        groups = values.reshape(self.key_heads, 2, -1, values.shape[-1])
        self.beta.copy_(groups[:, 0].reshape(self.beta.shape))
        self.alpha.copy_(groups[:, 1].reshape(self.alpha.shape))


def _beta_alpha(model: PreTrainedModel, beta_name: str) -> list[tuple[str, np.ndarray, Any]]:
    layer = beta_name.split(".")[2]
    beta = model.get_parameter(beta_name).data
    alpha = model.get_parameter(beta_name.replace("in_proj_b", "in_proj_a")).data
    target = _BetaAlpha(beta, alpha, model.config.linear_num_key_heads)
    return [(f"blk.{layer}.ssm_ba.weight", target.merged(), target)]


def _tensors(
    name: str, parameter: torch.Tensor, arch: str, mixture: bool = False
) -> list[tuple[str, np.ndarray, torch.Tensor]]:
    """The file's tensors of one parameter, each with the part of the parameter it restores: one, or the gate's and
    the up's halves of a mixture's experts (``mlp.experts.gate_up_proj``, as the converter splits it)."""
    layer = name.split(".")[2] if name.startswith("model.layers.") else ""
    if arch == "gpt-oss" and ".mlp.experts." in name:
        return _oai_experts(name, parameter, layer)
    if arch in QWEN35 and ".linear_attn." in name:
        return _qwen35_tensors(name, parameter, layer, tiled=arch != "qwen3next")
    if arch == "granitehybrid" and (".mamba." in name or ".shared_mlp." in name):
        return _granite_hybrid_tensors(name, parameter, layer, mixture)
    if name.endswith("conv.conv.weight"):  # LFM2's depthwise convolution: [channels, span], as the converter has it
        return [(f"blk.{layer}.shortconv.conv.weight", parameter.detach()[:, 0].float().numpy(), parameter.data)]
    if name.endswith("self_attn.sinks"):
        return [(f"blk.{layer}.attn_sinks.weight", parameter.detach().float().numpy(), parameter.data)]
    if name.endswith(("mlp.experts.gate_up_proj", "block_sparse_moe.experts.gate_up_proj")):
        gate, up = parameter.data.chunk(2, dim=1)
        return [(f"blk.{layer}.ffn_{kind}_exps.weight", half.float().numpy().copy(), half)
                for kind, half in (("gate", gate), ("up", up))]  # fmt: skip
    if name.endswith(("mlp.experts.down_proj", "block_sparse_moe.experts.down_proj")):
        return [(f"blk.{layer}.ffn_down_exps.weight", parameter.detach().float().numpy(), parameter.data)]
    return [(_gguf_name(name, arch), parameter.detach().float().numpy(), parameter.data)]


def _oai_experts(name: str, parameter: torch.Tensor, layer: str) -> list[tuple[str, np.ndarray, torch.Tensor]]:
    """gpt-oss's experts as its converter writes them: transformers' ``[experts, in, out]`` matrices transposed, the
    gate's and up's interleaved columns (and biases) split apart."""
    kind = name.rsplit(".", 1)[1]  # gate_up_proj, gate_up_proj_bias, down_proj, down_proj_bias
    suffix = "bias" if kind.endswith("_bias") else "weight"
    if kind.startswith("down_proj"):
        view = parameter.data.transpose(1, 2) if suffix == "weight" else parameter.data
        return [(f"blk.{layer}.ffn_down_exps.{suffix}", view.float().numpy().copy(), view)]
    out = []
    for part, half in (("gate", 0), ("up", 1)):
        view = parameter.data[..., half::2]
        view = view.transpose(1, 2) if suffix == "weight" else view
        out.append((f"blk.{layer}.ffn_{part}_exps.{suffix}", view.float().numpy().copy(), view))
    return out


def _gguf_name(name: str, arch: str) -> str:
    if name in _GEMMA4_MODEL:
        return _GEMMA4_MODEL[name]
    if name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if name == "lm_head.weight":
        return "output.weight"
    if name == "model.norm.weight":
        return "output_norm.weight"
    if name == "model.embedding_norm.weight":  # LFM2's final norm
        return "token_embd_norm.weight"
    _, _, index, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    names = {"gemma3": _GEMMA_LAYER, "phi3": _PHI3_LAYER, "gpt-oss": _OAI_LAYER, "granitemoe": _GRANITE_MOE_LAYER,
             "lfm2": _LFM2_LAYER, "qwen35": _QWEN35_LAYER, "qwen35moe": _QWEN35_LAYER, "qwen3next": _QWEN35_LAYER,
             "granitehybrid": _GRANITE_HYBRID_LAYER, "gemma4": _GEMMA4_LAYER}.get(arch, _LAYER)  # fmt: skip
    return f"blk.{index}.{names[module]}.{kind}"


def _qwen35_keys(config: Any, writer: GGUFWriter, arch: str) -> None:
    """What llama.cpp's converter adds for Qwen3.5: the linear attention's shapes, its layers, the rotated dims."""
    writer.add_uint32(f"{arch}.ssm.conv_kernel", config.linear_conv_kernel_dim)
    writer.add_uint32(f"{arch}.ssm.state_size", config.linear_key_head_dim)
    writer.add_uint32(f"{arch}.ssm.group_count", config.linear_num_key_heads)
    writer.add_uint32(f"{arch}.ssm.time_step_rank", config.linear_num_value_heads)
    writer.add_uint32(f"{arch}.ssm.inner_size", config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_array(f"{arch}.attention.recurrent_layers", [kind == "linear_attention" for kind in config.layer_types])
    writer.add_uint32(f"{arch}.full_attention_interval", 4)
    writer.add_rope_dimension_count(int(config.head_dim * config.rope_parameters["partial_rotary_factor"]))
    writer.add_array(f"{arch}.rope.dimension_sections", [11, 11, 10, 0])


def _granite_hybrid_keys(config: Any, writer: GGUFWriter) -> None:
    """What llama.cpp's converter adds for Granite 4.0-H: the Mamba-2 shapes (its heads as ``time_step_rank``),
    that its attention does not rotate, and its mixture's sizes where it has one."""
    if config.num_local_experts:
        writer.add_expert_count(config.num_local_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        writer.add_expert_shared_feed_forward_length(config.shared_intermediate_size)
    writer.add_ssm_conv_kernel(config.mamba_d_conv)
    writer.add_ssm_state_size(config.mamba_d_state)
    writer.add_ssm_group_count(config.mamba_n_groups)
    writer.add_ssm_inner_size(config.mamba_n_heads * config.mamba_d_head)
    writer.add_ssm_time_step_rank(config.mamba_n_heads)
    writer.add_rope_scaling_finetuned(config.position_embedding_type == "rope")


def _granite_hybrid_tensors(
    name: str, parameter: torch.Tensor, layer: str, mixture: bool
) -> list[tuple[str, np.ndarray, Any]]:
    """A Granite 4.0-H Mamba-2 tensor (or its MLP's stacked gate and up) as its converter writes it: ``A_log`` as
    ``-exp(A_log)``, ``A`` and ``D`` as ``[heads, 1]``, ``dt_bias`` as ``ssm_dt.bias``, the convolution squeezed,
    the gated norm's weights by group; the gate's and up's rows apart."""
    values = parameter.detach().float().numpy().copy()
    part = name.rsplit(f".{layer}.", 1)[1]
    shared = "_shexp" if mixture else ""  # beside a mixture, the converter names the MLP a shared expert
    if part == "shared_mlp.input_linear.weight":
        gate, up = parameter.data.chunk(2, dim=0)
        return [(f"blk.{layer}.ffn_{kind}{shared}.weight", half.float().numpy().copy(), half)
                for kind, half in (("gate", gate), ("up", up))]  # fmt: skip
    if part == "shared_mlp.output_linear.weight":
        return [(f"blk.{layer}.ffn_down{shared}.weight", values, parameter.data)]
    groups = GRANITE_MAMBA["mamba_n_groups"]
    simple = {"mamba.A_log": ("ssm_a", lambda v: -np.exp(v)[:, None]), "mamba.D": ("ssm_d", lambda v: v[:, None]),
              "mamba.dt_bias": ("ssm_dt.bias", None), "mamba.conv1d.weight": ("ssm_conv1d.weight", lambda v: v[:, 0]),
              "mamba.conv1d.bias": ("ssm_conv1d.bias", None),
              "mamba.norm.weight": ("ssm_norm.weight", lambda v: v.reshape(groups, -1))}  # fmt: skip
    if part in simple:
        gguf_name, shaped = simple[part]
        written = values if shaped is None else shaped(values)
        return [(f"blk.{layer}.{gguf_name}", np.ascontiguousarray(written), parameter.data)]
    return [(_gguf_name(name, "granitehybrid"), values, parameter.data)]


def _qwen35_tensors(
    name: str, parameter: torch.Tensor, layer: str, tiled: bool = True
) -> list[tuple[str, np.ndarray, torch.Tensor]]:
    """A Qwen3.5 linear attention's tensor as its converter writes it: the value heads tiled (``_qwen35_order``;
    not ``tiled``: Qwen3-Next's, grouped as transformers holds them), ``A_log`` as ``-exp(A_log)``, ``dt_bias`` as
    ``ssm_dt.bias``, the convolution squeezed."""
    config = _QWEN35_CONFIG
    part = name.split(".linear_attn.")[1]
    values = parameter.detach().float().numpy().copy()

    def order(kind: str, values: np.ndarray) -> np.ndarray:
        return _qwen35_order(kind, values, config) if tiled else values

    if part == "A_log":
        return [(f"blk.{layer}.ssm_a", order("ssm_beta", -np.exp(values)), parameter.data)]
    if part == "dt_bias":
        return [(f"blk.{layer}.ssm_dt.bias", order("ssm_beta", values), parameter.data)]
    if part == "conv1d.weight":
        return [(f"blk.{layer}.ssm_conv1d.weight", order("attn_qkv", values[:, 0]), parameter.data)]
    module, kind = part.rsplit(".", 1)
    gguf = _QWEN35_LAYER[f"linear_attn.{module}"]
    return [(f"blk.{layer}.{gguf}.{kind}", order(gguf, values), parameter.data)]


#: The tiny Qwen3.5's linear attention's shapes, as ``_qwen35_order`` reads them.
_QWEN35_CONFIG = QWEN35_LINEAR


def _qwen35_order(kind: str, values: np.ndarray, config: Any, untile: bool = False) -> np.ndarray:
    """A linear attention's tensor with its value heads in the converter's tiled order (or back, ``untile``)."""
    shapes = config if isinstance(config, dict) else config.to_dict()
    keys = shapes["linear_num_key_heads"] * shapes["linear_key_head_dim"]
    head = shapes["linear_value_head_dim"]
    if kind == "attn_qkv":  # the value rows (or channels) only
        return np.concatenate([values[: 2 * keys], _tile(values[2 * keys :], 0, shapes, head, untile)])
    if kind == "attn_gate":
        return _tile(values, 0, shapes, head, untile)
    if kind in ("ssm_beta", "ssm_alpha"):
        return _tile(values, 0, shapes, 1, untile)
    if kind == "ssm_out":
        return _tile(values, 1, shapes, head, untile)
    return values


def _tile(values: np.ndarray, dim: int, shapes: dict, head: int, untile: bool = False) -> np.ndarray:
    """llama.cpp's converter's ``_reorder_v_heads``: value heads grouped by key head ``[K0: v0 v1, K1: v0 v1]`` to
    tiled ``[K0 v0, K1 v0, K0 v1, K1 v1]`` along ``dim`` (``untile``: back)."""
    keys, per_key = shapes["linear_num_key_heads"], shapes["linear_num_value_heads"] // shapes["linear_num_key_heads"]
    outer = [per_key, keys] if untile else [keys, per_key]
    shape = list(values.shape)
    split = values.reshape(*shape[:dim], *outer, head, *shape[dim + 1 :])
    return np.ascontiguousarray(np.swapaxes(split, dim, dim + 1)).reshape(shape)


def _phi3_keys(model: PreTrainedModel, writer: GGUFWriter) -> None:
    """What llama.cpp's converter adds for Phi-3: the rotated dims, the pretraining context, LongRoPE's factors as
    tensors and its attention factor."""
    import math

    config = model.config
    rope = config.rope_parameters
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    if rope.get("rope_type") == "longrope":
        scale = config.max_position_embeddings / config.original_max_position_embeddings
        writer.add_rope_scaling_attn_factors(
            math.sqrt(1 + math.log(scale) / math.log(config.original_max_position_embeddings))
        )
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _permute(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of llama's query/key rows for its RoPE."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    return rows.reshape(heads, rows.shape[0] // heads // 2, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


#: The bundled vocabulary's unused special tokens renamed to Qwen2.5-Coder's FIM tokens (``renamed``).
QWEN_FIM = {7: "<|fim_prefix|>", 8: "<|fim_suffix|>", 9: "<|fim_middle|>", 10: "<|fim_pad|>", 3: "<|repo_name|>",
            5: "<|file_sep|>"}  # fmt: skip


#: A file's tokenizer keys: (name, value, the value's type; an array's is ARRAY).
TokenizerKeys = list[tuple[str, Any, GGUFValueType]]


@functools.lru_cache(maxsize=8)
def tokenizer_keys(path: Path) -> TokenizerKeys:
    """The ``tokenizer.*`` keys of the GGUF at ``path``, read once (gguf-py's reader takes seconds on a vocabulary)."""
    fields = GGUFReader(path).fields.items()
    return [(name, field.contents(), field.types[0]) for name, field in fields if name.startswith("tokenizer.")]


def _copy_tokenizer(keys: TokenizerKeys, writer: GGUFWriter, renamed: dict[int, str], template: str | None) -> None:
    """The tokenizer's keys, the special tokens ``renamed`` by id, the chat template ``template`` if given."""
    for name, value, kind in keys:
        if name == "tokenizer.chat_template" and template is not None:
            writer.add_chat_template(template)
            continue
        if name == "tokenizer.ggml.tokens" and renamed:
            tokens = list(value)
            for index, token in renamed.items():
                tokens[index] = token
            writer.add_array(name, tokens)
            continue
        if kind == GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, kind)


def gemma_vocabulary(size: int = 2000) -> Any:
    """A vocabulary as Gemma 4's is made (llama.cpp's ``gemma4`` tokenizer: BPE over raw UTF-8 with byte fallback,
    spaces as "▁", no word splitting; pad, eos, bos and unk first, then the 256 byte tokens), trained here on the
    project's own docs: a transformers tokenizer that llama.cpp's Gemma 4 converter reads (its ``LlamaHfVocab``)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    root = Path(__file__).resolve().parents[1]
    lines = [line for f in sorted((root / "docs").glob("*.md")) for line in f.read_text().splitlines() if line.strip()]
    trainer = trainers.BpeTrainer(vocab_size=size - 260, show_progress=False)
    learner = Tokenizer(models.BPE())
    learner.normalizer = normalizers.Replace(" ", "\u2581")
    learner.train_from_iterator(lines, trainer)
    learnt = json.loads(learner.to_str())["model"]
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {token: index for index, token in enumerate(specials + [f"<0x{b:02X}>" for b in range(256)])}
    for token in sorted(learnt["vocab"], key=learnt["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in learnt["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   bos_token="<bos>", unk_token="<unk>")  # fmt: skip


def save_checkpoint(
    arch: str,
    directory: Path,
    hidden: int = 128,
    layers: int = 6,
    dtype: torch.dtype = torch.float32,
    std: float = 0.05,
    **shape: int,
) -> PreTrainedModel:
    """A model of ``arch`` with random weights (``hidden`` wide, ``layers`` deep; Gemma 3 1B's window and pattern,
    Phi-3-mini-4k's window) and the bundled model's tokenizer, saved in ``directory`` as a HuggingFace checkpoint
    that llama.cpp's ``convert_hf_to_gguf.py`` converts; matrices of ``std`` (larger: peaked next-token
    distributions, whose greedy tokens rounding does not flip). Returned."""
    import json

    from transformers import AutoTokenizer

    from engine.runtime import loader

    gguf = loader._default_gguf()
    if arch == "gemma4":  # its converter reads only a byte-fallback BPE vocabulary, as Gemma 4's
        tokenizer = gemma_vocabulary()
    else:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = tiny_model(arch, vocab=len(tokenizer)).config
    config.hidden_size, config.intermediate_size, config.num_hidden_layers = hidden, hidden * 3, layers
    for name, value in shape.items():  # e.g. num_attention_heads, num_key_value_heads, head_dim, intermediate_size
        setattr(config, name, value)
    kinds = getattr(config, "layer_types", None)
    if kinds:  # gemma3's period of 6 (its tiny model has 6 layers); the others' all alike
        config.layer_types = [kinds[i % len(kinds)] for i in range(layers)]
    if getattr(config, "no_rope_layers", None):  # SmolLM3: every 4th layer without RoPE, however many layers
        config.no_rope_layers = [int((i + 1) % 4 != 0) for i in range(layers)]
    if arch == "gemma3":
        config.sliding_window = 512
    if arch == "phi3":
        config.sliding_window = 2047
    if arch == "granitehybrid":  # dense (its one MLP the shared one) unless given experts; Mamba-2 twice as wide
        config.shared_intermediate_size = shape.get("shared_intermediate_size", config.intermediate_size)
        config.mamba_d_head = 2 * hidden // config.mamba_n_heads
    model_class = _MODELS[arch][1]
    if arch == "qwen3next":  # transformers' own Qwen3-Next (its fused in_proj_qkvz and in_proj_ba), as released
        config, model_class = _qwen3_next(config)
    torch.manual_seed(0)
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.uniform_(-0.2, 0.2).add_(0.0 if arch == "gemma3" else 1.0)
            else:
                parameter.normal_(0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):  # Gemma 4's: each layer's own, so that each counts
                buffer.uniform_(0.5, 1.5)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    # The class the converter loads the vocabulary with: phi3's reads a BPE one only under GPT2Tokenizer's name;
    # for the others, transformers' Qwen2Tokenizer would put its own pre-tokenizer over the file's.
    tokenizer_class = "GPT2Tokenizer" if arch == "phi3" else "PreTrainedTokenizerFast"
    settings = directory / "tokenizer_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "tokenizer_class": tokenizer_class}))
    if arch == "granitehybrid":  # the layers' kinds as released checkpoints name them (the converter reads those)
        saved = directory / "config.json"
        legacy = {"linear_attention": "mamba", "full_attention": "attention"}
        written = json.loads(saved.read_text())
        saved.write_text(json.dumps({**written, "layer_types": [legacy[k] for k in written["layer_types"]]}))
    if arch == "qwen35moe":  # transformers loads Qwen3.5-MoE's own tokenizer whatever the class named (its
        # pre-tokenizer over the bundled vocabulary: one the converter does not know); the converter picks its
        # model's class by `architectures`, so the model type may be the dense family's, whose class is honoured
        saved = directory / "config.json"
        saved.write_text(json.dumps({**json.loads(saved.read_text()), "model_type": "qwen3_5_text"}))
    return model


def _qwen3_next(config: Any) -> tuple[Any, type]:
    """The tiny Qwen3.5-MoE's shape as transformers' Qwen3-Next config, and its model class."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
              "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
              "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size", "layer_types",
              "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings", "rope_parameters")  # fmt: skip
    return Qwen3NextConfig(
        **{name: getattr(config, name) for name in fields}, norm_topk_prob=True
    ), Qwen3NextForCausalLM


def convert(checkpoint: Path, out: Path, llama_cpp: Path, outtype: str = "f32") -> None:
    """llama.cpp's own converter run on ``checkpoint`` (its tree at ``llama_cpp``, with its gguf-py)."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(llama_cpp / "gguf-py")}
    command = [sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile", str(out)]
    model_type = json.loads((checkpoint / "config.json").read_text()).get("model_type")
    if model_type in ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"):  # no multi-token prediction layers to write
        command.append("--no-mtp")
    done = subprocess.run([*command, "--outtype", outtype], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {done.stderr[-2000:]}")


#: gpt-oss's vocabulary (o200k_harmony): o200k_base's 199,998 ranks, then its special tokens up to 201,088.
HARMONY_VOCAB = 201_088
HARMONY_SPECIALS = {199998: "<|startoftext|>", 199999: "<|endoftext|>", 200002: "<|return|>", 200003: "<|constrain|>",
                    200005: "<|channel|>", 200006: "<|start|>", 200007: "<|end|>", 200008: "<|message|>",
                    200012: "<|call|>", 200018: "<|endofprompt|>"}  # fmt: skip
#: Enough of gpt-oss's chat template for a server to know it writes harmony (a harmony model's prompt is rendered
#: by openai-harmony, not by its template).
HARMONY_TEMPLATE = (
    "{%- for m in messages %}<|start|>{{ m.role }}<|channel|>final<|message|>{{ m.content }}<|end|>{%- endfor %}"
    "{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)


def o200k_ranks() -> list[bytes]:
    """o200k_base's tokens by rank, from the data file of PyPI's ``quicktok-v1`` (a dev dependency): a count, then
    each token's length (u16), bytes and rank (u32). The server checks them against OpenAI's SHA-256."""
    import importlib.util
    import struct

    spec = importlib.util.find_spec("quicktok")
    assert spec is not None and spec.submodule_search_locations, "quicktok-v1 is a dev dependency (make install)"
    data = (Path(spec.submodule_search_locations[0]) / "data" / "o200k.vocab").read_bytes()
    (count,) = struct.unpack_from("<I", data)
    ranks: list[bytes] = [b""] * count
    offset = 4
    for _ in range(count):
        (size,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2 : offset + 2 + size]
        (rank,) = struct.unpack_from("<I", data, offset + 2 + size)
        ranks[rank] = token
        offset += 6 + size
    return ranks


def _bpe_merges(ranks: list[bytes]) -> list[tuple[bytes, bytes]]:
    """The merges that build each token from its bytes: the last pair byte-pair encoding joins, with only the lower
    ranks (tiktoken's ranks are the merges' order)."""
    rank_of = {token: rank for rank, token in enumerate(ranks)}
    merges = []
    for rank, token in enumerate(ranks):
        if len(token) < 2:
            continue
        parts = [bytes([byte]) for byte in token]
        while len(parts) > 2:
            pairs = [(rank_of.get(a + b, rank), i) for i, (a, b) in enumerate(itertools.pairwise(parts))]
            _, i = min(pairs)
            parts[i : i + 2] = [parts[i] + parts[i + 1]]
        merges.append((parts[0], parts[1]))
    return merges


@functools.cache
def harmony_tokenizer() -> TokenizerKeys:
    """gpt-oss's tokenizer keys, as its converter writes them (``tokenizer_from`` for a tiny gpt-oss model that
    speaks harmony)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelled = bytes_to_unicode()
    ranks = o200k_ranks()
    as_text = ["".join(spelled[byte] for byte in token) for token in ranks]
    names = [HARMONY_SPECIALS.get(i, f"<|reserved_{i}|>") for i in range(len(ranks), HARMONY_VOCAB)]
    merges = ["".join(spelled[b] for b in a) + " " + "".join(spelled[c] for c in b) for a, b in _bpe_merges(ranks)]
    array, text, number = GGUFValueType.ARRAY, GGUFValueType.STRING, GGUFValueType.UINT32
    return [
        ("tokenizer.ggml.model", "gpt2", text), ("tokenizer.ggml.pre", "gpt-4o", text),
        ("tokenizer.ggml.tokens", as_text + names, array),
        ("tokenizer.ggml.token_type", [1] * len(ranks) + [3] * len(names), array),
        ("tokenizer.ggml.merges", merges, array), ("tokenizer.ggml.bos_token_id", 199998, number),
        ("tokenizer.ggml.eos_token_id", 200002, number), ("tokenizer.ggml.padding_token_id", 199999, number),
        ("tokenizer.chat_template", HARMONY_TEMPLATE, text),
    ]  # fmt: skip
