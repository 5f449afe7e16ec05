"""Model runners: one packed forward over a step's rows, returning logits for the rows that are sampled.

``LlamaRunner`` is a lean forward for llama-architecture models (SmolLM2 among them): fused QKV and gate/up
projections with prepacked weights, one RoPE table per step, no per-layer module dispatch, and in bfloat16 on
the CPU one native op for each element-wise step between the matmuls. A decode step runs on a few rows, so
on this project's 2-core CPU the number of ops counts as much as their arithmetic. ``HFRunner`` runs any
other transformers causal LM through its own forward, with ``block_attention`` registered as its attention
function.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from engine.core.architectures import Architecture, by_model_type, config_value
from engine.runtime import delta_rule as rule
from engine.runtime import kernels
from engine.runtime.attention import ATTENTION_NAME, attend, block_attention
from engine.runtime.kv_cache import StepBatch
from engine.runtime.quantized_weights import PackedParts, PackedWeight, QuantizedWeight

AttentionInterface.register(ATTENTION_NAME, block_attention)
log = logging.getLogger(__name__)


class ModelRunner(Protocol):
    #: The fewest rows a step multiplies on a dense copy of quantized weights (None: never).
    dense_from_rows: int | None

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """``token_ids`` and ``positions`` are ``[rows]``; returns float32 logits for ``rows`` (all if None)."""
        ...


def make_runner(
    model: PreTrainedModel,
    max_positions: int,
    quantized: dict[str, QuantizedWeight] | None = None,
    invariant: bool = True,
    dense_from_rows: int | None = None,
) -> ModelRunner:
    """The runner for ``model``, for sequences of up to ``max_positions`` positions; ``quantized``: weight
    matrices to multiply in their GGUF blocks (``engine/runtime/gguf_weights.py``), by transformers' name. ``invariant``
    and ``dense_from_rows``: see ``LlamaRunner`` (other architectures run as transformers computes them)."""
    model.eval()
    if LlamaRunner.supports(model):
        return LlamaRunner(model, max_positions, quantized or {}, invariant, dense_from_rows)
    arch = by_model_type(model.config.model_type)
    if (arch is not None and arch.recurrent) or _kept_between_steps(model.config):
        # transformers' forward keeps nothing between steps here: no recurrent state, no KV another layer wrote
        raise ValueError(f"this {model.config.model_type} model's configuration is not served by the native runner")
    if quantized:
        raise ValueError(f"quantized weights are served for llama models only, not {model.config.model_type}")
    return HFRunner(model)


def _kept_between_steps(config: object) -> bool:
    """Whether a model keeps between steps what transformers' forward here (each step its rows alone) does not: a
    recurrent layer's state (Qwen3-Next's, any hybrid's by its layers' kinds) or KV that later layers read instead
    of their own (Gemma 4's, in its multimodal checkpoints' text model too)."""
    text = getattr(config, "text_config", None) or config
    kinds = getattr(text, "layer_types", None) or []
    return bool(set(kinds) & _RECURRENT_KINDS) or bool(getattr(text, "num_kv_shared_layers", 0))


#: The kinds of layers (a config's ``layer_types``) that keep a state per sequence.
_RECURRENT_KINDS = {"linear_attention", "conv", "mamba"}


class HFRunner:
    dense_from_rows = None

    def __init__(self, model: PreTrainedModel) -> None:
        model.set_attn_implementation(ATTENTION_NAME)
        self._decoder = model.get_decoder()
        self._lm_head = model.get_output_embeddings()

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, rows: torch.Tensor | None
    ) -> torch.Tensor:
        hidden = self._decoder(
            input_ids=token_ids[None], position_ids=positions[None], use_cache=False, step_batch=batch
        ).last_hidden_state[0]
        return self._lm_head(hidden if rows is None else hidden[rows]).float()


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ``[out, in]`` in the layout the device's matmul reads fastest. On CPU that is oneDNN's
    blocked layout, reordered once here instead of inside every plain ``F.linear`` call: decode steps ran
    1.3-1.9x faster with it on this project's CPU. Elsewhere the weight is returned as it is."""
    if weight.device.type == "cpu" and weight.dtype in _PACKABLE and torch.backends.mkldnn.is_available():
        try:
            # Detached: a packed weight that kept a Parameter's requires_grad took another path outside
            # inference mode, whose result for a row changed with the number of rows.
            return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_ROWS_HINT)
        except RuntimeError as exc:  # e.g. bfloat16 on a CPU without AVX-512: oneDNN has no such kernel
            _warn_unpacked(weight.dtype, str(exc))
    return weight


@functools.cache  # once per dtype and reason, not once per weight
def _warn_unpacked(dtype: torch.dtype, reason: str) -> None:
    log.warning("%s weights stay unpacked (plain matmuls, slower steps, no batch invariance): %s", dtype, reason)


def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight | PackedParts, tile: int | None = None) -> torch.Tensor:
    """``x @ weight.T`` for a ``weight`` from ``prepack`` or a GGUF's packed blocks; ``x`` is ``[rows, in]``.
    ``tile``: a dense product runs in calls of exactly this many rows (the last one padded), so that every row is
    computed by the same kernel whatever the number of rows (``DENSE_TILE``); quantized blocks need no tiles."""
    if isinstance(weight, PackedWeight | PackedParts):
        return weight.matmul(x)
    rows = x.shape[0]
    if tile is None or rows == 0:
        return _dense(x, weight)
    padding = -rows % tile
    if padding:
        x = torch.cat([x, x.new_zeros(padding, x.shape[1])])
    return torch.cat([_dense(x[start : start + tile], weight) for start in range(0, rows + padding, tile)])[:rows]


def _dense(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")
    return F.linear(x, weight)


_PACKABLE = (torch.float32, torch.bfloat16)
#: Rows per dense product when batch invariance is on. oneDNN picks its kernel (and how it splits the sum over the
#: input dimension) by the number of rows: on AVX-512 + AMX machines a bfloat16 row's result changed when 33 or
#: more rows shared the call. With every call of one shape, one kernel computes every row, and a row's result does
#: not depend on its place in the tile (tested) nor on the thread count. 16 is one AMX tile of rows; measured there
#: (bfloat16), a 16-row call costs 1.0-1.3x a one-row call, and a 64-row step in 16-row tiles ~2x one 64-row call.
DENSE_TILE = 16
# oneDNN picks the blocked layout for a typical row count; measured here, any hint from 1 to 256 rows
# serves every batch size within noise.
_PACK_ROWS_HINT = 32


Weight = torch.Tensor | PackedWeight | PackedParts


@dataclass(slots=True)
class _Experts:
    """A mixture of experts in place of the MLP (``Architecture.experts``): the router and each expert's gated MLP."""

    router: Weight  # [experts, hidden]
    gate_up: list[Weight]  # an expert's gate and up rows stacked: [2 * intermediate, hidden]
    down: list[Weight]  # [hidden, intermediate]
    top_k: int
    renormalize: bool  # the chosen experts' weights scaled to sum to 1
    #: A shared expert every row takes (qwen2moe): its gate and up rows, its down, and its gate's vector ``[hidden]``
    #: (None: no gate, Granite 4.0-H's).
    shared: tuple[Weight, Weight, torch.Tensor | None] | None = None
    #: The softmax over the top k logits only, not over all experts (gpt-oss).
    top_k_softmax: bool = False
    #: gpt-oss (``Architecture.oai_experts``): the router's bias, each expert's gate-and-up and down biases, and the
    #: clamped SwiGLU's alpha and limit.
    router_bias: torch.Tensor | None = None
    gate_up_bias: torch.Tensor | None = None  # [experts, 2 * intermediate], gate's then up's
    down_bias: torch.Tensor | None = None  # [experts, hidden]
    clamp: tuple[float, float] | None = None
    #: Every expert's packed gate-and-up blocks ``[experts, groups, bytes]``, their type and outputs, then the same
    #: for down (``moe_mixture``'s arguments; ``gate_up`` and ``down`` are views of them); None unless each list is
    #: one packed matrix an expert, of one type and shape.
    stacked: tuple[torch.Tensor, int, int, torch.Tensor, int, int] | None = None

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's chosen experts ``[rows, k]`` and their weights (float32), from the router's ``logits``."""
        logits = logits.float() if self.router_bias is None else (logits + self.router_bias).float()
        if self.top_k_softmax:
            top, chosen = torch.topk(logits, self.top_k, dim=-1)
            return torch.softmax(top, dim=-1), chosen
        weights, chosen = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return (weights / weights.sum(dim=-1, keepdim=True) if self.renormalize else weights), chosen


@dataclass(slots=True)
class _DeltaNet:
    """Qwen3.5's linear attention's shapes, vectors and gates' projections (its other matrices are the layer's
    ``qkv``: query, key and value, then z; ``conv``; ``o``)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    decay: torch.Tensor  # -exp(A_log), float32 [value heads]
    dt_bias: torch.Tensor  # float32 [value heads]
    norm: torch.Tensor  # the gated norm's weights [value dim]
    gates: Weight  # b's and a's projections stacked (a row each value head: beta's and the decay's)
    tiled: bool = False  # the value heads in llama.cpp's converter's order (``delta_rule.prepare``)


@dataclass(slots=True)
class _Mamba:
    """A Mamba-2 layer's shapes and vectors (Granite 4.0-H; its matrices are the layer's ``qkv``: its input
    projection, ``z``, ``x``, ``B``, ``C`` and a step per head; ``conv``; ``o``)."""

    heads: int
    head_dim: int
    state: int  # B's and C's size a group
    groups: int  # heads share B and C by groups: head h reads group h // (heads / groups)
    decay: torch.Tensor  # A = -exp(A_log), float32 [heads]
    dt_bias: torch.Tensor  # float32 [heads]
    skip: torch.Tensor  # D, float32 [heads]
    conv_bias: torch.Tensor | None  # [channels]
    norm: torch.Tensor  # the grouped gated norm's weights [heads * head dim]


@dataclass(slots=True)
class _PerLayerInputs:
    """Gemma 4's per-layer inputs (E2B, E4B): each token's rows of its own table (``layers * width`` wide, scaled
    by sqrt(width)), added to the embedding's projection (scaled by 1/sqrt(hidden), normalized each layer's width
    apart), the sum scaled by 1/sqrt(2); layer i takes its i-th ``width``."""

    table: torch.Tensor | PackedWeight  # [vocab, layers * width]
    projection: Weight  # [layers * width, hidden]
    norm: torch.Tensor  # [width]
    width: int
    table_scale: torch.Tensor  # sqrt(width), in the model's dtype
    projection_scale: float  # 1 / sqrt(hidden)


@dataclass(slots=True)
class _LlamaLayer:
    input_norm: torch.Tensor
    qkv: Weight  # q, k, v stacked: [(heads + 2 * kv_heads) * dim, hidden]
    o: torch.Tensor | PackedWeight
    post_norm: torch.Tensor
    gate_up: Weight | None  # [2 * intermediate, hidden]; None in a mixture of experts
    down: torch.Tensor | PackedWeight | None
    qkv_bias: torch.Tensor | None = None  # q, k and v's biases stacked (qwen2)
    q_norm: torch.Tensor | None = None  # each query head's RMSNorm weights (qwen3, gemma3)
    k_norm: torch.Tensor | None = None
    qk_norm_whole: bool = False  # ... the whole query's and key's, all heads together (olmoe)
    attn_out_norm: torch.Tensor | None = None  # the attention's output normalized before the residual add (gemma3)
    ffn_out_norm: torch.Tensor | None = None  # ... and the MLP's
    gelu: bool = False  # the MLP's gate through GELU (tanh), not SiLU (gemma3)
    window: int = 0  # a sliding-window layer: each row attends its last `window` positions (0: all)
    rope: str | None = None  # which RoPE table the layer rotates by (gemma3's local and global layers differ)
    experts: _Experts | None = None  # the MLP's place taken by a mixture of experts
    o_bias: torch.Tensor | None = None  # the attention output's bias (gpt-oss)
    sinks: torch.Tensor | None = None  # each query head's attention sink (gpt-oss)
    residual_scale: float = 1.0  # each block's output multiplied by it before the residual add (granite)
    #: A short convolution layer (LFM2) in the attention's place: its depthwise weights ``[channels, span]``; ``qkv``
    #: is then its input projection (``B``, ``C``, ``x`` stacked) and ``o`` its output projection.
    conv: torch.Tensor | None = None
    #: The layer's index among the layers of its kind: in the KV cache (attention), or in the states (convolution).
    cache_index: int = 0
    #: Qwen3.5's linear attention in the attention's place (with ``conv``, ``qkv`` its input projections stacked:
    #: query, key and value, then z; ``o`` its output projection).
    delta: _DeltaNet | None = None
    attn_gate: bool = False  # a gate beside each query head (Qwen3.5)
    #: Granite 4.0-H's Mamba-2 layer in the attention's place (with ``conv``; ``qkv`` its input projection, ``o`` its
    #: output projection).
    mamba: _Mamba | None = None
    rotary: int = 0  # the dims of each head RoPE turns (0: all)
    #: Gemma 4 (``Architecture.value_norm``): each value head RMS-normalized, the scores unscaled; this layer's KV
    #: heads (its kind's); ``qkv`` holds the query and key only (the keys are the values: its global layers), or the
    #: query only (it reads the KV an earlier layer wrote at ``cache_index``: its last layers).
    value_norm: bool = False
    kv_heads: int = 0
    keys_as_values: bool = False
    shares_kv: bool = False
    #: Gemma 4's per-layer input: its gate's and projection's weights and the projection's norm.
    per_layer: tuple[Weight, Weight, torch.Tensor] | None = None
    scalar: torch.Tensor | None = None  # the residual stream times it after the layer (Gemma 4's layer scalar)

    def extras(self) -> dict[str, torch.Tensor | int | bool | None]:
        """What an architecture adds to a llama layer, as ``llama_layer``'s keyword arguments."""
        return {
            "qkv_bias": self.qkv_bias, "q_norm": self.q_norm, "k_norm": self.k_norm, "window": self.window,
            "attn_out_norm": self.attn_out_norm, "ffn_out_norm": self.ffn_out_norm, "gelu": self.gelu,
            "residual_scale": self.residual_scale,
        }  # fmt: skip

    def packed(self) -> tuple[object, ...] | None:
        """The arguments ``llama_layer`` takes for this layer's weights, up to its post-attention norm; None unless
        every projection is one matrix of packed quantized blocks."""
        projections = (self.qkv, self.o, self.gate_up, self.down)
        if (
            self.qk_norm_whole
            or self.o_bias is not None
            or self.sinks is not None
            or self.conv is not None
            or (self.attn_gate or self.rotary or self.value_norm)
        ):
            return None
        if not all(isinstance(p, PackedWeight) for p in projections):
            return None  # (the native layer normalizes each head)
        qkv, o, gate_up, down = ((p.data, p.qtype, p.out_features) for p in projections)  # type: ignore[union-attr]
        return (*qkv, *o, self.post_norm, *gate_up, *down)


class LlamaRunner:
    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """A model of a natively served architecture (``engine/core/architectures.py``) without what the lean
        forward leaves out."""
        config = model.config
        arch = by_model_type(config.model_type)
        activation = getattr(config, "hidden_act", None) or getattr(config, "hidden_activation", None) or "silu"
        return (
            arch is not None
            and not (config.model_type == "llama" and getattr(config, "attention_bias", False))
            and not getattr(config, "mlp_bias", False)
            and not getattr(config, "use_sliding_window", False)  # qwen2's, by max_window_layers
            and activation == arch.activation
            and not getattr(config, "attn_logit_softcapping", None)
            and not getattr(config, "use_bidirectional_attention", False)
            # RoPE from a table of every position: not for scalings that change with the sequence's length
            and (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default") != "dynamic"
        )

    def __init__(
        self,
        model: PreTrainedModel,
        max_positions: int,
        quantized: dict[str, QuantizedWeight] | None = None,
        invariant: bool = True,
        dense_from_rows: int | None = None,
    ) -> None:
        """``quantized``: matrices served in their GGUF blocks, by transformers' name; the rest are prepacked.
        ``invariant``: every row of a dense product is computed in ``DENSE_TILE``-row calls, so that a row's
        result does not depend on its batchmates. ``dense_from_rows`` (not invariant, some matrices quantized):
        steps of at least this many rows multiply a dense copy of the weights instead, where the CPU's dense
        kernels (oneDNN's AMX bfloat16 ones) outrun the quantized kernel (``engine/core/batch_mode.py``)."""
        quantized = quantized or {}
        self.tile = DENSE_TILE if invariant else None
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config_value(config, "num_key_value_heads")
        self.head_dim = config_value(config, "head_dim") or config.hidden_size // self.num_heads
        self.scale = (
            getattr(config, "attention_multiplier", None)
            or (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        )
        self.eps = getattr(config, "rms_norm_eps", None) or config.norm_eps  # (LFM2's name)
        self.softcap = getattr(config, "final_logit_softcapping", None)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0) or 1.0)  # granite divides by it
        inner = model.model
        arch = by_model_type(config.model_type)
        assert arch is not None  # supports() holds
        self._embeddings(model, quantized, max_positions)
        # torch.compile of the element-wise work between the matmuls was tried and dropped: with the matmuls
        # outside (oneDNN's prepacked weights are opaque to it), each compiled call cost 50-120 us against
        # 10-70 us eager, and whole steps came out no faster for ~30 s more start-up.
        self.layers = [self._fuse(layer, f"model.layers.{i}.", quantized, arch) for i, layer in enumerate(inner.layers)]
        _number_by_kind(self.layers, bool(getattr(config, "linear_v_tiled", False)))
        _share_kv(self.layers, getattr(config, "layer_types", None))
        # From the first layer that reads another's KV on, only the rows a step samples are computed: no later layer
        # writes KV, so the others' results would go nowhere (Gemma 4's last 20 of 35 layers, in E2B).
        self._first_shared = next((i for i, layer in enumerate(self.layers) if layer.shares_kv), None)
        if arch.value_norm:  # (Gemma 4's heads are normalized: its scores are not scaled)
            self.scale = 1.0
        # The dense twin of quantized layers, for steps of many rows (``dense_from_rows``).
        self._dense_from_rows = dense_from_rows if quantized and not invariant else None
        self._dense_layers: list[_LlamaLayer] = []
        self._dense_head: torch.Tensor | None = None
        if self._dense_from_rows is not None:
            self._dense_layers = [
                self._fuse(layer, f"model.layers.{i}.", {}, arch) for i, layer in enumerate(inner.layers)
            ]
            _number_by_kind(self._dense_layers, bool(getattr(config, "linear_v_tiled", False)))
            _share_kv(self._dense_layers, getattr(config, "layer_types", None))
            self._dense_head = prepack(model.lm_head.weight)
        # The norm after each layer: the following layer's input norm, then the final norm.
        self._next_norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        self._native_ops(model, quantized)

    def _embeddings(self, model: PreTrainedModel, quantized: dict[str, QuantizedWeight], max_positions: int) -> None:
        """The token embedding, RoPE's tables, the final norm and the output layer."""
        # The token embedding, dense; or, when served from its GGUF blocks, read from them row by row (the dense
        # copy is then not kept: ~113 MB in float32 for SmolLM2).
        embedding = quantized.get("model.embed_tokens.weight")
        self.embed: torch.Tensor | PackedWeight = model.model.embed_tokens.weight
        if embedding is not None:
            self.embed = embedding.pack()
        self.dtype = model.dtype
        arch = by_model_type(model.config.model_type)
        assert arch is not None  # supports() holds
        # Gemma multiplies the embedding by sqrt(hidden size), rounded to its dtype as transformers (and Gemma) do.
        # Granite multiplies it by its config's embedding multiplier.
        scale = model.config.hidden_size**0.5 if arch.scaled_embedding else None
        if arch.multipliers:
            scale = model.config.embedding_multiplier
        self.embed_scale = torch.tensor(scale).to(self.dtype) if scale is not None else None
        self.ropes = _rope_tables(model, max_positions)
        self.norm = _norm_weight(model.get_submodule(arch.name("model.norm")).weight, arch.norm_offset)
        self.per_layer_inputs = _per_layer_inputs(model, quantized)
        head = quantized.get("lm_head.weight")
        # A tied output layer reads the embedding's packed blocks: one copy of them.
        self.lm_head = (
            prepack(model.lm_head.weight) if head is None
            else self.embed if head is embedding and isinstance(self.embed, PackedWeight)
            else head.pack()
        )  # fmt: skip

    def _native_ops(self, model: PreTrainedModel, quantized: dict[str, QuantizedWeight]) -> None:
        """The element-wise ops between the matmuls: native where they build, else torch's."""
        # bfloat16 on the CPU: the element-wise steps between the matmuls as one native op each (~30 torch
        # ops a layer otherwise). Dense float32 keeps torch's ops, token-identical to `generate`; float32 over
        # quantized weights has no such parity to keep, and takes the native ops too.
        cpu = model.device.type == "cpu"
        native = cpu and (model.dtype == torch.bfloat16 or (model.dtype == torch.float32 and bool(quantized)))
        ops = kernels.native_ops() if native else None
        self._add_norm = _add_norm if ops is None else ops.add_rms_norm
        self._rope = _rope if ops is None else ops.rope
        self._silu_mul = _silu_mul if ops is None else ops.silu_mul
        self._gelu_mul = _gelu_mul if ops is None else ops.gelu_mul
        self._moe = None if ops is None else ops.moe_mixture
        self._recurrent_ops = ops  # (csrc/recurrent_steps.cpp)
        # Every projection quantized: each layer in one native call where the cache's native attention serves
        # the step (``csrc/llama_layer.cpp``: the same ops, without their Python dispatch between them).
        packed = [layer.packed() for layer in self.layers]
        attention = [p for p, layer in zip(packed, self.layers, strict=True) if layer.conv is None]
        self._layer_op = ops.llama_layer if ops is not None and all(p is not None for p in attention) else None
        self._packed = packed
        self._extras = [layer.extras() for layer in self.layers]  # built once, not a dict a layer a step

    @staticmethod
    def _fuse(
        layer: torch.nn.Module, prefix: str, quantized: dict[str, QuantizedWeight], arch: Architecture
    ) -> _LlamaLayer:
        """One decoder layer's weights as the lean forward takes them (``arch``: what its architecture adds)."""

        def fused(names: list[str], linears: list[torch.nn.Module]) -> Weight:
            own = [arch.name(name) for name in names]  # the family's names of llama's modules
            parts = [part for name in own if (part := quantized.get(f"{prefix}{name}.weight")) is not None]
            if len(parts) != len(names):
                return prepack(_stack_into_views(linears) if len(linears) > 1 else linears[0].weight)  # type: ignore[arg-type]
            stacked = QuantizedWeight.stack(parts)
            return stacked.pack() if stacked is not None else PackedParts(tuple(part.pack() for part in parts))

        def norm(name: str) -> torch.Tensor:
            return _norm_weight(layer.get_submodule(arch.name(name)).weight, arch.norm_offset)

        sandwich = arch.output_norms  # Gemma 3 names the norm of the attention's output "post attention"
        experts, gate_up, down = _mlp(layer, prefix, quantized, fused, arch)
        post_norm = norm("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
        if getattr(layer, "linear_attn", None) is not None:  # Qwen3.5's linear attention in the attention's place
            return _delta_layer(layer.linear_attn, fused, norm("input_layernorm"), post_norm, gate_up, down, experts)
        if getattr(layer, "mamba", None) is not None:  # Granite 4.0-H's Mamba-2 layer in the attention's place
            return _mamba_layer(layer, fused, norm("input_layernorm"), post_norm, (gate_up, down, experts))
        if getattr(layer, "conv", None) is not None:  # LFM2's short convolution in the attention's place
            mixer = fused(["conv.in_proj"], [layer.conv.in_proj]), fused(["conv.out_proj"], [layer.conv.out_proj])
            conv = layer.conv.conv.weight.detach()[:, 0]  # [channels, span]
            return _LlamaLayer(norm("input_layernorm"), *mixer, post_norm, gate_up, down, experts=experts, conv=conv)
        attn = layer.self_attn
        if arch.value_norm:
            return _gemma4_layer(layer, fused, norm, gate_up, down)
        # (Phi-3 holds them fused already)
        names = ["self_attn.qkv_proj"] if arch.fused_projections else [f"self_attn.{p}_proj" for p in "qkv"]
        return _LlamaLayer(
            norm("input_layernorm"),
            fused(names, [layer.get_submodule(name) for name in names]),
            fused(["self_attn.o_proj"], [layer.get_submodule(arch.name("self_attn.o_proj"))]),  # type: ignore[arg-type]
            post_norm,
            gate_up,
            down,
            torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach() if arch.qkv_bias else None,
            norm("self_attn.q_norm") if arch.qk_norm else None,
            norm("self_attn.k_norm") if arch.qk_norm else None,
            arch.qk_norm_whole,
            norm("post_attention_layernorm") if sandwich else None,
            norm("post_feedforward_layernorm") if sandwich else None,
            arch.activation != "silu",
            _window(attn.config, attn.layer_idx),
            _rope_kind(attn.config, attn.layer_idx),
            experts,
            attn.o_proj.bias.detach() if arch.output_bias else None,
            attn.sinks.detach().float() if arch.sinks else None,
            float(getattr(attn.config, "residual_multiplier", 1.0)) if arch.multipliers else 1.0,
            attn_gate=arch.gated_attention,
            rotary=_rotary(attn.config),
        )

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, rows: torch.Tensor | None
    ) -> torch.Tensor:
        if isinstance(self.embed, PackedWeight):
            hidden = self.embed.rows(token_ids, self.dtype)
        else:
            hidden = F.embedding(token_ids, self.embed)
        if self.embed_scale is not None:
            hidden = hidden * self.embed_scale
        per_layer = None if self.per_layer_inputs is None else self._per_layer(token_ids, hidden)
        ropes = {kind: (cos[positions], sin[positions]) for kind, (cos, sin) in self.ropes.items()}  # [rows, dim]
        normed = _rms_norm(hidden, self.layers[0].input_norm, self.eps)
        dense = self.runs_dense(token_ids.shape[0])
        layers = self._dense_layers if dense else self.layers
        for index, (layer, next_norm) in enumerate(zip(layers, self._next_norms, strict=True)):
            if index == self._first_shared and rows is not None and batch.cache.native_decode:
                hidden, normed, per_layer, ropes, batch = _only_rows(rows, hidden, normed, per_layer, ropes, batch)
                rows = None
                if not hidden.shape[0]:  # no row sampled (a prompt's chunk that goes on): nothing left to compute
                    break
            native = self._layer_op is not None and not dense and layer.conv is None
            kv = batch.cache.native_kv(layer.cache_index) if native else None
            cos, sin = ropes[layer.rope]  # shared by every head
            if kv is not None:
                hidden, normed = self._layer_op(
                    hidden, normed, *self._packed[index], next_norm, self.eps, cos, sin, self.num_heads,
                    self.num_kv_heads, *kv, batch.slots, batch.block_tables, batch.lengths, batch.cache.block_size,
                    self.scale, **self._extras[index],
                )  # fmt: skip
                continue
            layer_input = None if per_layer is None else per_layer[:, index]
            hidden, normed = self._layer(layer, next_norm, layer_input, hidden, normed, cos, sin, batch)
        if rows is not None:
            normed = normed[rows]  # none at all when the step's prompt chunks all go on: [0, vocab] logits
        head = self._dense_head if self._dense_head is not None and self.runs_dense(normed.shape[0]) else self.lm_head
        logits = linear(normed, head, self.tile).float()
        if self.logits_scaling != 1.0:
            logits = logits / self.logits_scaling
        if not self.softcap:
            return logits
        softcap = self.softcap  # each row alone: torch's tanh gave a row's last bits by its place among the rows
        return torch.cat([torch.tanh(row / softcap) * softcap for row in logits.split(1)] or [logits])

    def _per_layer(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Each row's per-layer inputs ``[rows, layers, width]`` (``_PerLayerInputs``), from its token and its
        scaled embedding ``hidden``."""
        inputs = self.per_layer_inputs
        assert inputs is not None
        rows, width = token_ids.shape[0], inputs.width
        if isinstance(inputs.table, PackedWeight):
            own = inputs.table.rows(token_ids, self.dtype)
        else:
            own = F.embedding(token_ids, inputs.table)
        own = (own * inputs.table_scale).view(rows, -1, width)
        projected = (linear(hidden, inputs.projection, self.tile) * inputs.projection_scale).view(rows, -1, width)
        norm, eps = inputs.norm, self.eps
        projected = _by_rows(lambda x: _rms_norm(x, norm, eps), projected)
        return (projected + own) * 2**-0.5

    @property
    def dense_from_rows(self) -> int | None:
        """The fewest rows a step multiplies on the dense copy of quantized weights (None: never)."""
        return self._dense_from_rows

    def runs_dense(self, rows: int) -> bool:
        """Whether a product of ``rows`` rows takes the dense copy of quantized weights (``dense_from_rows``)."""
        return self._dense_from_rows is not None and rows >= self._dense_from_rows

    def _layer(
        self, layer: _LlamaLayer, next_norm: torch.Tensor, layer_input: torch.Tensor | None, hidden: torch.Tensor,
        normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One decoder layer op by op: the residual stream after it, and its normalization by ``next_norm``
        (``layer_input``: its per-layer input ``[rows, width]``, Gemma 4's)."""
        tile = self.tile
        if layer.delta is not None:
            output = self._delta_net(layer, normed, batch)
        elif layer.mamba is not None:
            output = self._mamba(layer, normed, batch)
        elif layer.conv is not None:
            output = self._short_conv(layer, normed, batch)
        elif layer.value_norm:
            output = self._normed_attention(layer, normed, cos, sin, batch)
        else:
            output = self._attention(layer, normed, cos, sin, batch)
        if layer.residual_scale != 1.0:
            output = output * layer.residual_scale
        hidden, normed = self._add_norm(hidden, output, layer.post_norm, self.eps, layer.attn_out_norm)
        if layer.experts is not None:
            output = self._mixture(normed, layer.experts)
        else:
            assert layer.gate_up is not None and layer.down is not None
            gate_up = linear(normed, layer.gate_up, tile)
            output = linear(self._gelu_mul(gate_up) if layer.gelu else self._silu_mul(gate_up), layer.down, tile)
        if layer.residual_scale != 1.0:
            output = output * layer.residual_scale
        if layer.per_layer is None and layer.scalar is None:
            return self._add_norm(hidden, output, next_norm, self.eps, layer.ffn_out_norm)
        hidden, _ = self._add_norm(hidden, output, next_norm, self.eps, layer.ffn_out_norm)
        return self._layer_end(layer, next_norm, layer_input, hidden)

    def _layer_end(
        self, layer: _LlamaLayer, next_norm: torch.Tensor, layer_input: torch.Tensor | None, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gemma 4's end of a layer: its per-layer input (the residual stream's gate, GELU, times the input,
        projected, normalized, added), the stream times the layer's scalar, normalized for the next block."""
        if layer.per_layer is not None and layer_input is not None:
            gate, projection, norm = layer.per_layer
            gated = self._gelu_mul(torch.cat([linear(hidden, gate, self.tile), layer_input], dim=-1))
            hidden, _ = self._add_norm(hidden, linear(gated, projection, self.tile), norm, self.eps, norm)
        if layer.scalar is not None:
            hidden = hidden * layer.scalar
        return hidden, _rms_norm(hidden, next_norm, self.eps)

    def _normed_attention(
        self, layer: _LlamaLayer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """Gemma 4's attention: each query and key head RMS-normalized (its weights) and rotated, each value head
        normalized (no weights), the scores unscaled; the keys as the values where the layer has no value
        projection; the KV an earlier layer wrote where it shares it. Its norms run as ``_by_rows`` runs them."""
        rows, heads, kv_heads, eps = normed.shape[0], self.num_heads, layer.kv_heads, self.eps
        projected = linear(normed, layer.qkv, self.tile)
        own = 0 if layer.shares_kv else 1 if layer.keys_as_values else 2  # key and value projections
        split = projected.view(rows, heads + own * kv_heads, -1)
        q_norm, k_norm = layer.q_norm, layer.k_norm
        assert q_norm is not None
        q = self._rope(_by_rows(lambda x: _rms_norm(x, q_norm, eps), split[:, :heads]), cos, sin)
        k = v = None
        if own:
            assert k_norm is not None
            raw_k = split[:, heads : heads + kv_heads]
            raw_v = raw_k if layer.keys_as_values else split[:, heads + kv_heads :]
            v = _by_rows(lambda x: F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype), raw_v)
            k = self._rope(_by_rows(lambda x: _rms_norm(x, k_norm, eps), raw_k), cos, sin)
        attended = attend(batch, layer.cache_index, q, k, v, self.scale, layer.window).reshape(rows, -1)
        return linear(attended, layer.o, self.tile)

    def _attention(
        self, layer: _LlamaLayer, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, batch: StepBatch
    ) -> torch.Tensor:
        """A layer's attention over the normalized rows, projected out."""
        rows = normed.shape[0]
        projected = linear(normed, layer.qkv, self.tile)
        if layer.qkv_bias is not None:
            projected = projected + layer.qkv_bias
        queries = self.num_heads * (2 if layer.attn_gate else 1)  # (a gate beside each query head: Qwen3.5)
        heads = projected.view(rows, queries + 2 * self.num_kv_heads, -1)
        gate = None
        qk = heads[:, : queries + self.num_kv_heads]
        if layer.attn_gate:
            paired = heads[:, :queries].reshape(rows, self.num_heads, 2, -1)
            gate = paired[:, :, 1].reshape(rows, -1)
            qk = torch.cat([paired[:, :, 0], heads[:, queries : queries + self.num_kv_heads]], dim=1)
        if layer.q_norm is not None and layer.k_norm is not None:  # each head normalized before its rotation
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
            if layer.attn_gate:  # (a layer the one-call op does not run: its functions as ``_by_rows`` runs them)
                q_norm, k_norm, eps = layer.q_norm, layer.k_norm, self.eps
                q = _by_rows(lambda x: _rms_norm(x, q_norm, eps), q)
                qk = torch.cat([q, _by_rows(lambda x: _rms_norm(x, k_norm, eps), k)], dim=1)
            elif layer.qk_norm_whole:  # all heads as one vector
                q = _rms_norm(q.reshape(q.shape[0], -1), layer.q_norm, self.eps).view(q.shape)
                k = _rms_norm(k.reshape(k.shape[0], -1), layer.k_norm, self.eps).view(k.shape)
                qk = torch.cat([q, k], dim=1)
            else:
                qk = torch.cat([_rms_norm(q, layer.q_norm, self.eps), _rms_norm(k, layer.k_norm, self.eps)], dim=1)
        if layer.rotary:  # the first dims of each head turn, the rest pass (Qwen3.5: a quarter)
            turned = self._rope(qk[..., : layer.rotary].contiguous(), cos, sin)
            qk = torch.cat([turned, qk[..., layer.rotary :]], dim=-1)
        else:
            qk = self._rope(qk, cos, sin)  # q and k in one pass
        q, k, v = qk[:, : self.num_heads], qk[:, self.num_heads :], heads[:, queries + self.num_kv_heads :]
        attended = attend(batch, layer.cache_index, q, k, v, self.scale, layer.window, layer.sinks).reshape(rows, -1)
        if gate is not None:
            attended = attended * _by_rows(torch.sigmoid, gate)
        output = linear(attended, layer.o, self.tile)
        return output if layer.o_bias is None else output + layer.o_bias

    def _delta_net(self, layer: _LlamaLayer, normed: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Qwen3.5's linear attention: query, key and value through the short convolution (SiLU), the gated delta
        rule, the gated norm by ``z``, projected out. Its element-wise functions run as ``_by_rows`` runs them."""
        net = layer.delta
        assert net is not None and layer.conv is not None and batch.states is not None
        rows, eps = normed.shape[0], self.eps
        keys, values = net.key_heads * net.key_dim, net.value_heads * net.value_dim
        mixed, z = linear(normed, layer.qkv, self.tile).split([2 * keys + values, values], dim=-1)
        gates = linear(normed, net.gates, self.tile)
        mixed = batch.states.convolve(layer.cache_index, mixed, layer.conv)
        if self._recurrent_ops is not None:  # the steps each side of the rule as one native op each
            ops = self._recurrent_ops
            q, k, v, decay, beta = ops.delta_inputs(mixed, gates, net.dt_bias, net.decay, net.key_heads,
                                                    net.value_heads, net.key_dim, net.value_dim, net.tiled)  # fmt: skip
            read = batch.states.delta_rule(layer.cache_index, q, k, v, decay, beta)
            return linear(ops.delta_output(read, z, net.norm, eps), layer.o, self.tile)
        b, a = gates.chunk(2, dim=-1)
        mixed = _by_rows(F.silu, mixed)
        q, k, v = mixed.split([keys, keys, values], dim=-1)
        q, k = (_by_rows(rule.l2norm, x.reshape(rows, net.key_heads, -1).float()) for x in (q, k))
        q, k = rule.prepare(q, k, net.value_heads, net.tiled)
        decay = net.decay * _by_rows(F.softplus, a.float() + net.dt_bias)
        beta = _by_rows(torch.sigmoid, b.float())  # (in float32 as the rule takes it, bfloat16 activations too)
        read = batch.states.delta_rule(
            layer.cache_index, q, k, v.reshape(rows, net.value_heads, -1).float(), decay, beta
        ).to(normed.dtype)
        z = z.reshape(rows, net.value_heads, -1).float()
        gated = _by_rows(lambda x: _rms_norm(x, net.norm, eps), read) * _by_rows(F.silu, z)
        return linear(gated.to(normed.dtype).reshape(rows, -1), layer.o, self.tile)

    def _mamba(self, layer: _LlamaLayer, normed: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Granite 4.0-H's Mamba-2 layer: ``x``, ``B``, ``C`` through the short convolution (its bias, SiLU); each
        head's matrix decayed by ``exp(dt A)``, moved by ``dt x B^T`` and read by ``C`` (the delta rule's op without
        its correction), plus ``D x``; times ``silu(z)``, RMS-normalized by groups; projected out. Its element-wise
        functions run as ``_by_rows`` runs them."""
        net = layer.mamba
        assert net is not None and layer.conv is not None and batch.states is not None
        rows, inner, shared = normed.shape[0], net.heads * net.head_dim, net.groups * net.state
        z, xbc, dt = linear(normed, layer.qkv, self.tile).split([inner, inner + 2 * shared, net.heads], dim=-1)
        xbc = batch.states.convolve(layer.cache_index, xbc, layer.conv)
        if self._recurrent_ops is not None:  # the steps each side of the scan as one native op each
            ops = self._recurrent_ops
            x, b, c, step, decay = ops.mamba_inputs(xbc, net.conv_bias, dt, net.dt_bias, net.decay, net.heads,
                                                    net.head_dim, net.groups, net.state)  # fmt: skip
            read = batch.states.delta_rule(layer.cache_index, c, b, x, decay, step, correct=False)
            return linear(ops.mamba_output(read, x, net.skip, z, net.norm, net.groups, self.eps), layer.o, self.tile)
        xbc = _by_rows(F.silu, xbc if net.conv_bias is None else xbc + net.conv_bias)
        x, b, c = xbc.float().split([inner, shared, shared], dim=-1)
        b, c = (t.reshape(rows, net.groups, 1, net.state).expand(-1, -1, net.heads // net.groups, -1)
                .reshape(rows, net.heads, net.state) for t in (b, c))  # fmt: skip
        step = _by_rows(F.softplus, dt.float() + net.dt_bias)  # [rows, heads]
        x = x.reshape(rows, net.heads, net.head_dim)
        read = batch.states.delta_rule(layer.cache_index, c, b, x, step * net.decay, step, correct=False)
        y = (read + x * net.skip[:, None]).reshape(rows, inner) * _by_rows(F.silu, z.float())
        groups = y.reshape(rows, net.groups, -1)
        y = _by_rows(lambda g: F.rms_norm(g, (g.shape[-1],), eps=self.eps), groups).reshape(rows, inner) * net.norm
        return linear(y.to(normed.dtype), layer.o, self.tile)

    def _short_conv(self, layer: _LlamaLayer, normed: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """LFM2's short convolution: ``C * conv(B * x)`` over each sequence's last positions, projected out."""
        assert layer.conv is not None and batch.states is not None
        b, c, x = linear(normed, layer.qkv, self.tile).chunk(3, dim=-1)
        return linear(c * batch.states.convolve(layer.cache_index, b * x, layer.conv), layer.o, self.tile)

    def _mixture(self, x: torch.Tensor, experts: _Experts) -> torch.Tensor:
        """Each row through its top-k experts, their outputs weighted and summed as transformers sums them: expert
        by expert in ascending order, an expert's rows read its weights once. A row's sum has that order and each
        expert's product of it is the same whatever rows share the step: the mixture is batch invariant."""
        weights, chosen = experts.route(linear(x, experts.router, self.tile))
        weights = weights.to(x.dtype)
        if experts.stacked is not None and self._moe is not None:  # the loop below in one native call
            alpha, limit = experts.clamp or (0.0, 0.0)
            biases = (experts.gate_up_bias, experts.down_bias)
            output = self._moe(x, weights, chosen, *experts.stacked, *biases, alpha, limit)
        else:
            output = torch.zeros_like(x)
            for expert in torch.unique(chosen).tolist():  # sorted
                rows, slot = torch.where(chosen == expert)
                output.index_add_(0, rows, self._expert(x[rows], experts, expert) * weights[rows, slot, None])
        if experts.shared is not None:  # added after the routed experts, as transformers adds it
            gate_up, down, gate = experts.shared
            shared = linear(self._silu_mul(linear(x, gate_up, self.tile)), down, self.tile)
            if gate is None:  # (Granite 4.0-H's shared MLP: no gate)
                return output + shared
            # The gate is one output: a dense product of one column summed a row's inputs in an order that
            # depended on the row's place in its tile; a row's own dot product does not. Its sigmoid by rows: torch's
            # gave a row's last bits by where it fell among the step's rows (seen on AVX-512 with BF16, Zen 4).
            output = output + _by_rows(torch.sigmoid, (x * gate).sum(dim=-1, keepdim=True)) * shared
        return output

    def _expert(self, x: torch.Tensor, experts: _Experts, expert: int) -> torch.Tensor:
        """One expert's gated MLP over the rows ``x`` that chose it."""
        gate_up = linear(x, experts.gate_up[expert], self.tile)
        if experts.clamp is None:
            return linear(self._silu_mul(gate_up), experts.down[expert], self.tile)
        assert experts.gate_up_bias is not None and experts.down_bias is not None
        gated = _clamped_swiglu(gate_up + experts.gate_up_bias[expert], *experts.clamp)
        return linear(gated, experts.down[expert], self.tile) + experts.down_bias[expert]


def _experts(
    mlp: torch.nn.Module, prefix: str, quantized: dict[str, QuantizedWeight],
    fused: Callable[[list[str], list[torch.nn.Module]], Weight], arch: Architecture,
) -> _Experts:  # fmt: skip
    """A mixture of experts' weights: each expert's in its blocks where the file holds them so
    (``gguf_weights.expert_name``), else its slices of transformers' 3-D parameters; the router's, and the shared
    expert's, as ``fused`` takes a layer's matrices."""
    count = mlp.experts.gate_up_proj.shape[0]
    gate_up: list[Weight] = []
    down: list[Weight] = []
    for expert in range(count):
        names = [f"{prefix}mlp.experts.{expert}.{part}.weight" for part in ("gate_proj", "up_proj", "down_proj")]
        gate, up, down_blocks = (quantized.get(name) for name in names)
        if gate is not None and up is not None:
            stacked = QuantizedWeight.stack([gate, up])
            gate_up.append(stacked.pack() if stacked is not None else PackedParts((gate.pack(), up.pack())))
        else:
            gate_up.append(prepack(_dense_expert(mlp.experts, expert, arch, "gate_up")))
        down.append(down_blocks.pack() if down_blocks is not None
                    else prepack(_dense_expert(mlp.experts, expert, arch, "down")))  # fmt: skip
    stacked = _stacked(gate_up, down)
    if arch.oai_experts:
        return _oai_experts(mlp, fused, gate_up, down, stacked)
    gate = getattr(mlp, arch.router)
    router = fused([f"{arch.mlp}.{arch.router}"], [gate])
    # (Qwen3.5-MoE's router has no such switch: it always renormalizes, as the family's row says)
    renormalize = bool(getattr(gate, "norm_topk_prob", arch.renormalized_experts))
    experts = _Experts(
        router, gate_up, down, gate.top_k, renormalize, top_k_softmax=arch.top_k_softmax, stacked=stacked
    )
    if arch.shared_expert:
        one, names = mlp.shared_expert, ["mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"]
        experts.shared = (fused(names, [one.gate_proj, one.up_proj]),
                          fused(["mlp.shared_expert.down_proj"], [one.down_proj]),
                          mlp.shared_expert_gate.weight.detach()[0])  # fmt: skip
    return experts


def _stacked(gate_up: list[Weight], down: list[Weight]) -> tuple[torch.Tensor, int, int, torch.Tensor, int, int] | None:
    """Every expert's packed blocks stacked, gate-and-up's then down's (``_Experts.stacked``), the lists' entries
    made views of them (no second copy kept); None unless each list is one packed matrix an expert of one type and
    shape."""
    for weights in (gate_up, down):
        first = weights[0]
        if not all(isinstance(w, PackedWeight) and (w.qtype, w.data.shape) == (first.qtype, first.data.shape)
                   for w in weights):  # fmt: skip
            return None
    stacked: list[torch.Tensor | int] = []
    for weights in (gate_up, down):
        first = weights[0]
        assert isinstance(first, PackedWeight)
        blocks = torch.stack([w.data for w in weights])  # type: ignore[union-attr]
        weights[:] = [PackedWeight(blocks[e], first.qtype, first.in_features, first.out_features)
                      for e in range(len(weights))]  # fmt: skip
        stacked += [blocks, first.qtype, first.out_features]
    return tuple(stacked)  # type: ignore[return-value]


def _dense_expert(experts: torch.nn.Module, expert: int, arch: Architecture, part: str) -> torch.Tensor:
    """An expert's gate-and-up rows (gate's first) or its down rows, ``[out, in]``, from transformers' 3-D parameters
    (gpt-oss's hold them ``[in, out]``, the gate's and up's columns interleaved: a copy, made only where the file has
    no blocks for it)."""
    if part == "down":
        down = experts.down_proj[expert]
        return down.T.contiguous() if arch.oai_experts else down
    gate_up = experts.gate_up_proj[expert]
    return torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]) if arch.oai_experts else gate_up


def _oai_experts(
    mlp: torch.nn.Module, fused: Callable[[list[str], list[torch.nn.Module]], Weight], gate_up: list[Weight],
    down: list[Weight], stacked: tuple[torch.Tensor, int, int, torch.Tensor, int, int] | None,
) -> _Experts:  # fmt: skip
    """gpt-oss's mixture: its router (with a bias), the experts' matrices, their biases (the gate's and up's
    interleaved in transformers' parameter, here gate's then up's as the rows are stacked) and the SwiGLU's clamp."""
    router, experts = mlp.router, mlp.experts
    bias = experts.gate_up_proj_bias.detach()
    return _Experts(
        fused(["mlp.router"], [router]), gate_up, down, router.top_k, False, top_k_softmax=True,
        router_bias=router.bias.detach(), gate_up_bias=torch.cat([bias[:, 0::2], bias[:, 1::2]], dim=1),
        down_bias=experts.down_proj_bias.detach(), clamp=(float(experts.alpha), float(experts.limit)), stacked=stacked,
    )  # fmt: skip


def _delta_layer(
    net: torch.nn.Module, fused: Callable[[list[str], list[torch.nn.Module]], Weight], input_norm: torch.Tensor,
    post_norm: torch.Tensor, gate_up: Weight | None, down: Weight | None, experts: _Experts | None,
) -> _LlamaLayer:  # fmt: skip
    """A Qwen3.5 linear-attention layer's weights: its query-key-value and z projections stacked, its b and a ones
    stacked, its convolution's weights ``[channels, span]``, its decay, bias and gated norm; its MLP's, or its
    mixture of experts' (Qwen3.5-MoE)."""
    projections = fused(["linear_attn.in_proj_qkv", "linear_attn.in_proj_z"], [net.in_proj_qkv, net.in_proj_z])
    delta = _DeltaNet(
        net.num_k_heads, net.num_v_heads, net.head_k_dim, net.head_v_dim, -net.A_log.detach().float().exp(),
        net.dt_bias.detach().float(), net.norm.weight.detach(),
        fused(["linear_attn.in_proj_b", "linear_attn.in_proj_a"], [net.in_proj_b, net.in_proj_a]),
    )  # fmt: skip
    output = fused(["linear_attn.out_proj"], [net.out_proj])
    conv = net.conv1d.weight.detach()[:, 0]
    return _LlamaLayer(
        input_norm,
        projections,
        output,
        post_norm,
        gate_up,
        down,
        experts=experts,
        conv=conv,
        delta=delta,  # type: ignore[arg-type]
    )


def _mlp(
    layer: torch.nn.Module, prefix: str, quantized: dict[str, QuantizedWeight],
    fused: Callable[[list[str], list[torch.nn.Module]], Weight], arch: Architecture,
) -> tuple[_Experts | None, Weight | None, Weight | None]:  # fmt: skip
    """A layer's mixture of experts, or its gated MLP's gate-and-up and down weights."""
    if arch.stacked_mlp:  # Granite 4.0-H: transformers' shared MLP (gate and up stacked), beside a mixture or alone
        own = arch.stacked_mlp.rpartition(".")[0]
        gate_up = fused([f"{own}.gate_proj", f"{own}.up_proj"], [layer.get_submodule(arch.stacked_mlp)])
        down = fused([f"{own}.output_linear"], [layer.get_submodule(f"{own}.output_linear")])
        if getattr(layer, arch.mlp, None) is None:
            return None, gate_up, down
        experts = _experts(layer.get_submodule(arch.mlp), prefix, quantized, fused, arch)
        experts.shared = (gate_up, down, None)  # joined without a gate
        return experts, None, None
    if arch.experts:
        return _experts(layer.get_submodule(arch.name(arch.mlp)), prefix, quantized, fused, arch), None, None
    names = ["mlp.gate_up_proj"] if arch.fused_projections else ["mlp.gate_proj", "mlp.up_proj"]
    gate_up = fused(names, [layer.get_submodule(arch.name(name)) for name in names])
    return None, gate_up, fused(["mlp.down_proj"], [layer.get_submodule(arch.name("mlp.down_proj"))])


def _mamba_layer(
    layer: torch.nn.Module, fused: Callable[[list[str], list[torch.nn.Module]], Weight], input_norm: torch.Tensor,
    post_norm: torch.Tensor, mlp: tuple[Weight | None, Weight | None, _Experts | None],
) -> _LlamaLayer:  # fmt: skip
    """A Granite 4.0-H Mamba-2 layer's weights: its input and output projections, its convolution's weights
    ``[channels, span]`` and bias, its decay, step bias, skip and gated norm; its MLP's (``mlp``: gate-and-up, down,
    or a mixture); its residual multiplier."""
    net, residual_scale = layer.mamba, float(layer.residual_multiplier)
    gate_up, down, experts = mlp
    projections = fused(["mamba.in_proj"], [net.in_proj]), fused(["mamba.out_proj"], [net.out_proj])
    mamba = _Mamba(
        net.num_heads, net.head_dim, net.ssm_state_size, net.n_groups, -net.A_log.detach().float().exp(),
        net.dt_bias.detach().float(), net.D.detach().float(),
        None if net.conv1d.bias is None else net.conv1d.bias.detach(), net.norm.weight.detach().float(),
    )  # fmt: skip
    conv = net.conv1d.weight.detach()[:, 0]
    return _LlamaLayer(input_norm, *projections, post_norm, gate_up, down, experts=experts,
                       residual_scale=residual_scale, conv=conv, mamba=mamba)  # fmt: skip


def _per_layer_inputs(model: PreTrainedModel, quantized: dict[str, QuantizedWeight]) -> _PerLayerInputs | None:
    """Gemma 4's per-layer inputs' weights (None: a model without them); its table read from its blocks where the
    file has it quantized (E2B's is 262,144 x 8,960: only the step's tokens' rows are read)."""
    inner, config = model.model, model.config
    width = getattr(config, "hidden_size_per_layer_input", 0) or 0
    if not width or getattr(inner, "embed_tokens_per_layer", None) is None:
        return None
    table = quantized.get("model.embed_tokens_per_layer.weight")
    projection = quantized.get("model.per_layer_model_projection.weight")
    return _PerLayerInputs(
        table.pack() if table is not None else inner.embed_tokens_per_layer.weight.detach(),
        projection.pack() if projection is not None else prepack(inner.per_layer_model_projection.weight),
        inner.per_layer_projection_norm.weight.detach(), width, torch.tensor(width**0.5).to(model.dtype),
        config.hidden_size**-0.5,
    )  # fmt: skip


def _gemma4_layer(
    layer: torch.nn.Module, fused: Callable[[list[str], list[torch.nn.Module]], Weight],
    norm: Callable[[str], torch.Tensor], gate_up: Weight | None, down: Weight | None,
) -> _LlamaLayer:  # fmt: skip
    """A Gemma 4 layer's weights: its query's projection, and its key's and value's where it has its own (not the
    KV-sharing last layers; no value's where the keys are the values); each head's norms; the attention's and MLP's
    output norms; its per-layer input's gate, projection and norm; its scalar (None where it is 1)."""
    attn = layer.self_attn
    config, index = attn.config, attn.layer_idx
    names = ["self_attn.q_proj"] + [f"self_attn.{p}_proj" for p in "kv" if getattr(attn, f"{p}_proj", None) is not None]
    per_layer = None
    if getattr(layer, "per_layer_input_gate", None) is not None:
        per_layer = (fused(["per_layer_input_gate"], [layer.per_layer_input_gate]),
                     fused(["per_layer_projection"], [layer.per_layer_projection]),
                     norm("post_per_layer_input_norm"))  # fmt: skip
    scalar = layer.layer_scalar.detach()
    return _LlamaLayer(
        norm("input_layernorm"), fused(names, [layer.get_submodule(name) for name in names]),
        fused(["self_attn.o_proj"], [attn.o_proj]), norm("pre_feedforward_layernorm"), gate_up, down,
        q_norm=norm("self_attn.q_norm"), k_norm=None if attn.is_kv_shared_layer else norm("self_attn.k_norm"),
        attn_out_norm=norm("post_attention_layernorm"), ffn_out_norm=norm("post_feedforward_layernorm"), gelu=True,
        window=_window(config, index), rope=_rope_kind(config, index), value_norm=True,
        kv_heads=config.per_layer_config[index].num_key_value_heads, keys_as_values=attn.use_alternative_attention,
        shares_kv=attn.is_kv_shared_layer, per_layer=per_layer, scalar=None if bool((scalar == 1).all()) else scalar,
    )  # fmt: skip


def _only_rows(
    rows: torch.Tensor, hidden: torch.Tensor, normed: torch.Tensor, per_layer: torch.Tensor | None,
    ropes: dict[str | None, tuple[torch.Tensor, torch.Tensor]], batch: StepBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, dict[str | None, tuple[torch.Tensor, torch.Tensor]],
           StepBatch]:  # fmt: skip
    """A step's rows narrowed to ``rows``: their residual streams, per-layer inputs, rotations and batch entries
    (their blocks and lengths, all the native attention reads)."""
    narrowed = StepBatch(batch.cache, 0, batch.slots[rows], batch.block_tables[rows], batch.lengths[rows])
    ropes = {kind: (cos[rows], sin[rows]) for kind, (cos, sin) in ropes.items()}
    return hidden[rows], normed[rows], None if per_layer is None else per_layer[rows], ropes, narrowed


def _share_kv(layers: list[_LlamaLayer], kinds: list[str] | None) -> None:
    """Each KV-sharing layer (Gemma 4's last ones) reads the cache of the last layer of its kind before them."""
    first = next((i for i, layer in enumerate(layers) if layer.shares_kv), len(layers))
    for layer, kind in zip(layers[first:], (kinds or [])[first:], strict=False):
        producer = max(i for i in range(first) if kinds and kinds[i] == kind)
        layer.cache_index = layers[producer].cache_index


def _rotary(config: object) -> int:
    """The dims of each head RoPE turns where it turns only part of them (Qwen3.5's partial rotary factor), else 0."""
    factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
    head_dim = config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads  # type: ignore[attr-defined]
    return int(head_dim * factor) if factor < 1.0 else 0


#: ``_by_rows``: a call's elements a multiple of this (torch's vector loops take 2 x 16 float32 at a time on
#: AVX-512, leaving the rest to a scalar loop whose exp/sigmoid round differently), and at most ``_BY_ROWS_CALL``
#: (below torch's grain of 32,768 elements: one thread computes a call, no split inside a vector).
_BY_ROWS_LANES = 64
_BY_ROWS_CALL = 16384


def _by_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` (element-wise, or over each row's last dimension) of ``x`` ``[rows, ...]``, each row's result the same
    bits whatever the number of rows: the rows are padded with zeros to a number whose elements (and those of a sum
    over the last dimension) fill whole vectors, in calls of at most a fixed number of rows. (torch's element-wise
    exp, sigmoid and rsqrt gave a row's last bits by where it fell among the call's elements.)"""
    x = x.contiguous()  # (a strided view takes another loop)
    rows = x.shape[0]
    inner = x[0].numel() if rows else 1
    reduced = inner // x.shape[-1]  # a row's values after a sum over its last dimension (a norm's): the fewest
    unit = _BY_ROWS_LANES // math.gcd(reduced, _BY_ROWS_LANES)  # rows whose (reduced) elements fill whole vectors
    per_call = max(unit, _BY_ROWS_CALL // inner // unit * unit)
    padded = -(-rows // unit) * unit
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, *x.shape[1:])])
    out = torch.cat([fn(x[start : start + per_call]) for start in range(0, padded, per_call)])
    return out[:rows]


def _number_by_kind(layers: list[_LlamaLayer], tiled: bool) -> None:
    """Each layer's index among its kind's (``_LlamaLayer.cache_index``): the KV cache holds the attention layers
    only, the states the recurrent layers only; ``tiled``: the linear attention's value heads are in the order of
    llama.cpp's converter (a GGUF's), not transformers'."""
    counts = {True: 0, False: 0}
    for layer in layers:
        if layer.delta is not None:
            layer.delta.tiled = tiled
        kind = layer.conv is not None
        layer.cache_index, counts[kind] = counts[kind], counts[kind] + 1


def _clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's gated activation as transformers computes it: the gate clamped above at ``limit``, the up to
    ``+-limit``, ``(up + 1) * gate * sigmoid(alpha gate)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    return (up.clamp(min=-limit, max=limit) + 1) * (gate * torch.sigmoid(gate * alpha))


def _add_norm(
    hidden: torch.Tensor, output: torch.Tensor, norm: torch.Tensor, eps: float, output_norm: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding a block's output (first normalized by ``output_norm``: Gemma 3), and its
    normalization for the next block."""
    if output_norm is not None:
        output = _rms_norm(output, output_norm, eps)
    hidden = hidden + output
    return hidden, _rms_norm(hidden, norm, eps)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """Gemma's gated MLP (GELU's tanh approximation), where the native ``gelu_mul`` does not build."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def _rope_kind(config: object, index: int) -> str | None:
    """The RoPE table layer ``index`` rotates by (``_rope_tables``): ``nope`` in a layer without RoPE (SmolLM3's),
    its kind where the kinds rotate differently (the config's RoPE parameters are by kind: Gemma 3), else None."""
    if not (getattr(config, "no_rope_layers", None) or [1] * (index + 1))[index]:
        return NOPE
    kinds = getattr(config, "layer_types", None)
    return kinds[index] if kinds and _rope_by_kind(config) else None


#: The table of the layers that attend without RoPE: cos 1, sin 0.
NOPE = "nope"


def _rope_by_kind(config: object) -> bool:
    parameters = getattr(config, "rope_parameters", None) or {}
    kinds = getattr(config, "layer_types", None) or []
    return bool(kinds) and all(kind in parameters for kind in kinds)


def _window(config: object, index: int) -> int:
    """Layer ``index``'s sliding window (0: none): the config's window in the layers its ``layer_types`` say slide
    (Gemma 3's local layers), or in every layer where it lists no kinds (Phi-3)."""
    window = getattr(config, "sliding_window", None) or 0
    kinds = getattr(config, "layer_types", None)
    return window if not kinds or kinds[index] == "sliding_attention" else 0


def _norm_weight(weight: torch.Tensor, offset: float) -> torch.Tensor:
    """An RMSNorm's weight as the lean forward multiplies by it: ``offset + w`` (Gemma's norms: ``1 + w``, computed
    in float32, then rounded to the model's dtype), or ``w`` itself."""
    return weight if not offset else (weight.detach().float() + offset).to(weight.dtype)


def _rope_tables(model: PreTrainedModel, max_positions: int) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
    """RoPE's cos and sin ``[positions, dim]`` for every position, computed once (a row's rotation is then a
    lookup, the same whatever other rows share its step: element-wise cos/sin may round a tensor's tail
    differently); by layer kind where the kinds rotate differently (Gemma 3's local and global layers), else
    one table under None."""
    positions = torch.arange(max_positions, device=model.device)[None]
    dummy = torch.empty(0, dtype=model.dtype, device=model.device)
    rotary = model.model.rotary_emb
    if rotary is None:  # no layer rotates (Granite 4.0-H): a rotation by 0 everywhere, x * 1 + rotated * 0 = x
        config = model.config
        width = config_value(config, "head_dim") or config.hidden_size // config.num_attention_heads
        ones = torch.ones(max_positions, width, dtype=model.dtype, device=model.device)
        return {None: (ones, torch.zeros_like(ones))}
    kinds = sorted(set(model.config.layer_types)) if _rope_by_kind(model.config) else [None]
    tables = {}
    for kind in kinds:
        cos, sin = rotary(dummy, positions) if kind is None else rotary(dummy, positions, kind)
        if 2 * cos.shape[-1] == config_value(model.config, "head_dim", 0) and not _rotary(model.config):  # gpt-oss's
            cos, sin = torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)
        tables[kind] = (cos[0], sin[0])
    if not all(getattr(model.config, "no_rope_layers", None) or [1]):  # a rotation by 0: x * 1 + rotated * 0 = x
        cos, _ = next(iter(tables.values()))
        tables[NOPE] = (torch.ones_like(cos), torch.zeros_like(cos))
    return tables


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As LlamaRMSNorm: normalize in float32, scale in the model's dtype.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[rows, heads, dim]`` rotated by its rows' ``cos``, ``sin`` ``[rows, dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


def _stack_into_views(linears: list[torch.nn.Linear]) -> torch.Tensor:
    """Stack the linears' weights into one tensor and make each linear's weight a view of it, so the fused
    projection costs no extra memory and the model stays usable as it was."""
    stacked = torch.cat([linear.weight.data for linear in linears], dim=0)
    offset = 0
    for linear in linears:
        size = linear.weight.shape[0]
        linear.weight.data = stacked[offset : offset + size]
        offset += size
    return stacked
