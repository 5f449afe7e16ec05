"""The model architectures served natively, one row each: what sets each apart from a llama, as the runner
(``engine/runtime/model_runner.py``), the GGUF reader (``engine/runtime/gguf_weights.py``, ``gguf_config.py``) and
the loader read it. A new architecture of the llama family is a new row here. No torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Architecture:
    #: ``general.architecture`` in a GGUF file.
    gguf: str
    #: transformers' ``model_type``.
    model_type: str
    #: llama.cpp's converter stores the query and key rows permuted for its RoPE (llama only): put back at load.
    permuted_qk: bool = False
    #: The query, key and value projections add a bias (not the output one).
    qkv_bias: bool = False
    #: Each query and key head is RMS-normalized (its own weights, over the head's dimension) before RoPE.
    qk_norm: bool = False
    #: ... over the whole query and the whole key instead, all heads together (OLMoE).
    qk_norm_whole: bool = False
    #: The attention's and the MLP's outputs are RMS-normalized before they join the residual stream (each with its
    #: own weights: the file's ``post_attention_norm`` and ``post_ffw_norm``; the MLP's input norm is ``ffn_norm``).
    output_norms: bool = False
    #: The gated MLP's activation, as transformers names it.
    activation: str = "silu"
    #: The token embedding is multiplied by the square root of the hidden size (rounded to the model's dtype).
    scaled_embedding: bool = False
    #: The model scales by ``offset + w`` in each RMSNorm; llama.cpp's converter writes ``offset + w`` in the file.
    norm_offset: float = 0.0
    #: The file stores the query, key and value projections as one matrix (``attn_qkv``) and the gate and up ones as
    #: one (``ffn_up``, gate rows first), as transformers' model holds them (``qkv_proj``, ``gate_up_proj``).
    fused_projections: bool = False
    #: Sliding-window layers (``<arch>.attention.sliding_window`` positions, their own RoPE base) among global ones,
    #: by ``<arch>.attention.sliding_window_pattern`` (this default when absent: every n-th layer is global).
    sliding_window_pattern: int = 0
    #: The MLP is a mixture of experts: a router (``ffn_gate_inp``) picks ``expert_used_count`` of ``expert_count``
    #: gated MLPs for each row (softmax over all, the top k), stored as 3-D tensors (``ffn_gate_exps``,
    #: ``ffn_up_exps``, ``ffn_down_exps``), each expert's matrix in its own blocks.
    experts: bool = False
    #: The chosen experts' weights renormalized to sum to 1 (as llama.cpp's graph of the family does).
    renormalized_experts: bool = False
    #: Beside the chosen experts, a shared one every row takes (``ffn_{gate,up,down}_shexp``), its output scaled by
    #: the sigmoid of its own gate (``ffn_gate_inp_shexp``).
    shared_expert: bool = False
    #: gpt-oss's mixture: the router adds a bias and takes the softmax of the top k logits only; every expert's
    #: projections add biases; its SwiGLU is clamped (gate at most 7, up within +-7: ``gate * sigmoid(1.702 gate) *
    #: (up + 1)``); transformers holds each expert's matrices ``[in, out]``, the gate's and up's columns interleaved.
    oai_experts: bool = False
    #: The attention's output projection adds a bias (gpt-oss).
    output_bias: bool = False
    #: Each query head has an attention sink (``attn_sinks``): a learned logit in its softmax's denominator.
    sinks: bool = False
    #: The router's softmax is over the top k logits only, not over all experts (gpt-oss, granitemoe).
    top_k_softmax: bool = False
    #: transformers' name of the layer's MLP (or mixture) module, and of the mixture's router in it.
    mlp: str = "mlp"
    router: str = "gate"
    #: Granite's multipliers, from the config (the file's ``<arch>.embedding_scale``, ``attention.scale``,
    #: ``residual_scale``, ``logit_scale``): the embedding times one, the attention's scale instead of
    #: 1/sqrt(head size), each block's output times one before the residual add, the logits divided by one.
    multipliers: bool = False
    #: Short convolution layers (LFM2) among the attention ones, by the config's ``layer_types`` ("conv"): the
    #: input projected to ``B``, ``C`` and ``x``, ``C * conv(B * x)`` over the last ``conv_L_cache`` positions (a
    #: depthwise causal convolution), projected out. Each sequence keeps its last positions' ``B * x`` as a state.
    short_conv: bool = False
    #: Linear-attention layers (Qwen3.5's Gated DeltaNet) among the attention ones, by the config's ``layer_types``
    #: ("linear_attention"): query, key and value through a short convolution (SiLU), a gated delta rule over each
    #: value head's matrix, a gated RMSNorm by ``z``, projected out. Each sequence keeps the convolution's last
    #: inputs and the matrices as its state.
    delta_net: bool = False
    #: The query projection holds a gate per head beside it (``[query, gate]`` a head): the attention's output is
    #: multiplied by the gate's sigmoid before the output projection (Qwen3.5).
    gated_attention: bool = False
    #: Every n-th layer (the n-th, the 2n-th, ...) attends without RoPE (SmolLM3's NoPE layers: llama.cpp's graph of
    #: the family fixes the period at 4, and its files carry no key for it).
    nope_period: int = 0
    #: Mamba-2 layers (Granite 4.0-H) among the attention ones, by the config's ``layer_types``
    #: ("linear_attention"): the input projected to ``z``, ``x``, ``B``, ``C`` and a step per head; ``x``, ``B``,
    #: ``C`` through a short convolution with a bias (SiLU); each head's ``[state, head dim]`` matrix decayed by
    #: ``exp(dt A)`` and moved by ``dt x B^T``, read by ``C``, plus ``D x``; a grouped RMSNorm of it times
    #: ``silu(z)``, projected out. Each sequence keeps the convolution's last inputs and the matrices as its state.
    mamba: bool = False
    #: transformers' module holding the MLP's gate and up rows as one matrix (gate first) where the file holds them
    #: apart: Granite 4.0-H's ``shared_mlp.input_linear`` (its output ``shared_mlp.output_linear``), the file's
    #: ``ffn_gate``/``ffn_up``/``ffn_down`` in a dense file, ``ffn_*_shexp`` beside a mixture of experts (``mlp``,
    #: when the config has experts: Tiny, Small), which it joins without a gate.
    stacked_mlp: str = ""
    #: Gemma 4's attention: each value head RMS-normalized (no weights) as the query and key heads are (with
    #: theirs), and the scores unscaled (1, not 1/sqrt(head size)). What its config gives is read from it: a head
    #: size and KV head count by layer kind, keys as values in the global layers (``attention_k_eq_v``), the last
    #: layers reading the KV of earlier ones (``num_kv_shared_layers``), per-layer inputs, each layer's scalar.
    value_norm: bool = False
    #: transformers' names of this family's modules where they are not llama's (``input_layernorm``,
    #: ``self_attn.o_proj``, ``mlp.gate_proj``, ``model.norm``, ...): pairs of llama's name and the family's.
    renamed: tuple[tuple[str, str], ...] = ()

    def mixture(self, config: object) -> bool:
        """Whether a model of this row with ``config`` has a mixture of experts (Granite 4.0-H's where its config
        has experts)."""
        return self.experts or (bool(self.stacked_mlp) and bool(getattr(config, "num_local_experts", 0)))

    def name(self, llama_name: str) -> str:
        """The family's name of a module llama names ``llama_name`` (a layer's relative name, or ``model.norm``)."""
        for llama, own in self.renamed:
            if llama_name == llama or llama_name.startswith(llama + "."):
                return own + llama_name[len(llama) :]
        return llama_name

    @property
    def recurrent(self) -> bool:
        """Some layers keep a state per sequence beside (or instead of) its KV blocks."""
        return self.short_conv or self.delta_net or self.mamba


#: LFM2's names of llama's modules.
_LFM2_NAMES = (
    ("input_layernorm", "operator_norm"), ("post_attention_layernorm", "ffn_norm"),
    ("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"), ("mlp.down_proj", "feed_forward.w2"),
    ("mlp", "feed_forward"),
    ("self_attn.o_proj", "self_attn.out_proj"), ("self_attn.q_norm", "self_attn.q_layernorm"),
    ("self_attn.k_norm", "self_attn.k_layernorm"), ("model.norm", "model.embedding_norm"),
)  # fmt: skip

# Qwen3.5-MoE (35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's layers, each MLP a mixture (its chosen experts'
# weights renormalized) beside a shared expert behind a sigmoid gate, as Qwen2-MoE's
_QWEN35_MOE = Architecture(
    "qwen35moe",
    "qwen3_5_moe_text",
    qk_norm=True,
    norm_offset=1.0,
    delta_net=True,
    gated_attention=True,
    experts=True,
    shared_expert=True,
    renormalized_experts=True,
)

ARCHITECTURES = {
    arch.gguf: arch
    for arch in (
        Architecture("llama", "llama", permuted_qk=True),  # Llama 2/3.x, SmolLM, Mistral-style files
        Architecture("qwen2", "qwen2", qkv_bias=True),  # Qwen2, Qwen2.5 (Coder), tied or separate output
        Architecture("qwen3", "qwen3", qk_norm=True),  # Qwen3 dense
        Architecture("qwen3moe", "qwen3_moe", qk_norm=True, experts=True, renormalized_experts=True),  # Qwen3-30B-A3B
        Architecture("qwen2moe", "qwen2_moe", qkv_bias=True, experts=True, shared_expert=True),  # Qwen1.5/2-MoE
        Architecture("olmoe", "olmoe", qk_norm=True, qk_norm_whole=True, experts=True),  # OLMoE-1B-7B: 8 of 64
        # gpt-oss-20b/120b: MXFP4 experts (4 of 32 or 128 a row), sinks, 128-position windows every other layer, YaRN
        Architecture(
            "gpt-oss",
            "gpt_oss",
            qkv_bias=True,
            output_bias=True,
            sinks=True,
            experts=True,
            oai_experts=True,
            top_k_softmax=True,
            router="router",
            sliding_window_pattern=2,
        ),
        Architecture("granite", "granite", permuted_qk=True, multipliers=True),  # Granite 3.x dense
        Architecture("smollm3", "smollm3", permuted_qk=True, nope_period=4),  # SmolLM3-3B: every 4th layer NoPE
        # Granite 3.x MoE (1B-A400M, 3B-A800M): the top k logits' softmax, JetMoE's fused experts split by the converter
        Architecture(
            "granitemoe",
            "granitemoe",
            permuted_qk=True,
            multipliers=True,
            experts=True,
            top_k_softmax=True,
            mlp="block_sparse_moe",
            router="router",
        ),
        Architecture("phi3", "phi3", fused_projections=True),  # Phi-3, Phi-3.5 mini (LongRoPE from the file)
        # Qwen3.5 (dense): three Gated DeltaNet layers for each gated attention one; norms scale by 1 + w; a quarter of
        # each head rotated
        Architecture("qwen35", "qwen3_5_text", qk_norm=True, norm_offset=1.0, delta_net=True, gated_attention=True),
        _QWEN35_MOE,
        # Qwen3-Next (80B-A3B): Qwen3.5-MoE's layers and transformers' Qwen3.5-MoE model for them; its file keeps the
        # value heads grouped by key head (not tiled) and beta's and alpha's rows in one tensor (``ssm_ba``)
        dataclasses.replace(_QWEN35_MOE, gguf="qwen3next"),
        # LFM2 (350M-2.6B): short convolutions in 10 of 16 layers, attention with head norms in the others
        Architecture("lfm2", "lfm2", qk_norm=True, short_conv=True, renamed=_LFM2_NAMES),
        # Granite 4.0-H (350M, 1B, Micro; Tiny, Small with a mixture of experts beside the MLP): Mamba-2 layers (36
        # of Micro's 40) beside attention layers without RoPE; Granite's multipliers
        Architecture(
            "granitehybrid",
            "granitemoehybrid",
            permuted_qk=True,
            multipliers=True,
            mamba=True,
            stacked_mlp="shared_mlp.input_linear",
            top_k_softmax=True,
            mlp="block_sparse_moe",
            router="router",
        ),
        # Gemma 3 (text): 5 local layers of 512-1024 positions for each global one
        Architecture(
            "gemma3",
            "gemma3_text",
            qk_norm=True,
            output_norms=True,
            activation="gelu_pytorch_tanh",
            scaled_embedding=True,
            norm_offset=1.0,
            sliding_window_pattern=6,
        ),
        # Gemma 4 (dense: E2B, E4B, 31B): local layers of 512-1024 positions, global ones with wider heads and a
        # quarter of each rotated; plain RMSNorm weights (not 1 + w)
        Architecture(
            "gemma4",
            "gemma4_text",
            qk_norm=True,
            output_norms=True,
            activation="gelu_pytorch_tanh",
            scaled_embedding=True,
            sliding_window_pattern=6,
            value_norm=True,
        ),
    )
}
#: Each model type's row: the first that names it (``qwen3next`` is read into Qwen3.5-MoE's model, whose row it is).
_BY_MODEL_TYPE: dict[str, Architecture] = {}
for _arch in ARCHITECTURES.values():
    _BY_MODEL_TYPE.setdefault(_arch.model_type, _arch)


class NotServedNatively(ValueError):
    """A model file this server refuses to serve from its blocks (its architecture, or a tensor type the native
    kernels do not read); the message names it and what is served."""


def config_value(config: object, key: str, default: object = None) -> Any:
    """``config``'s ``key`` (``default`` where it has none); where the config gives it by layer (transformers'
    heterogeneous configs, Gemma 4's head size and KV heads, which refuse a global read), the first layer's."""
    try:
        return getattr(config, key, default)
    except RuntimeError:  # (transformers' AmbiguousGlobalPerLayerAttributeError)
        return getattr(config.per_layer_config[0], key, default)  # type: ignore[attr-defined]


def by_model_type(model_type: str) -> Architecture | None:
    """The row of transformers' ``model_type`` (None: not served natively)."""
    return _BY_MODEL_TYPE.get(model_type)


def names() -> str:
    """The natively served architectures, as GGUF files name them, for messages."""
    return ", ".join(ARCHITECTURES)
