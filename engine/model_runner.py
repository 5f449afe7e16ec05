"""Model runners: one packed forward over a step's rows, returning logits for the rows that are sampled.

``LlamaRunner`` is a lean forward for llama-architecture models (SmolLM2 among them): fused QKV and gate/up
projections, one RoPE table per step, and no per-layer module dispatch. On this project's 2-core CPU a
decode step is dominated by Python and small-op overhead as much as by the matmuls, so fewer, larger ops
matter. ``HFRunner`` runs any other transformers causal LM through its own forward, with ``slot_attention``
registered as its attention function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel

from engine.kv_cache import ATTENTION_NAME, StepBatch, attend, slot_attention

AttentionInterface.register(ATTENTION_NAME, slot_attention)


class ModelRunner(Protocol):
    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, rows: torch.Tensor | None
    ) -> torch.Tensor:
        """``token_ids`` and ``positions`` are ``[rows]``; returns float32 logits for ``rows`` (all if None)."""
        ...


def make_runner(model: PreTrainedModel, compile: bool = False) -> ModelRunner:
    model.eval()
    if LlamaRunner.supports(model):
        return LlamaRunner(model, compile)
    return HFRunner(model)


class HFRunner:
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


@dataclass(slots=True)
class _LlamaLayer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: [(heads + 2 * kv_heads) * dim, hidden]
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class LlamaRunner:
    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        config = model.config
        return (
            config.model_type == "llama"
            and not getattr(config, "attention_bias", False)
            and not getattr(config, "mlp_bias", False)
            and getattr(config, "hidden_act", "silu") == "silu"
        )

    def __init__(self, model: PreTrainedModel, compile: bool = False) -> None:
        config = model.config
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.eps = config.rms_norm_eps
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.rotary = inner.rotary_emb
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.layers = [self._fuse(layer) for layer in inner.layers]
        # torch.compile fuses the small element-wise ops around the matmuls (norms, RoPE, SiLU, residuals):
        # ~10-20% off a decode step here, for ~30 s of compiling at start-up. Attention stays eager: its
        # shape depends on the step's mix of sequences.
        self._before_attention = torch.compile(_before_attention, dynamic=True) if compile else _before_attention
        self._after_attention = torch.compile(_after_attention, dynamic=True) if compile else _after_attention

    @staticmethod
    def _fuse(layer: torch.nn.Module) -> _LlamaLayer:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = _stack_into_views([attn.q_proj, attn.k_proj, attn.v_proj])
        gate_up = _stack_into_views([mlp.gate_proj, mlp.up_proj])
        return _LlamaLayer(
            layer.input_layernorm.weight,
            qkv,
            attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            gate_up,
            mlp.down_proj.weight,
        )

    def forward(
        self, token_ids: torch.Tensor, positions: torch.Tensor, batch: StepBatch, rows: torch.Tensor | None
    ) -> torch.Tensor:
        hidden = F.embedding(token_ids, self.embed)
        cos, sin = self.rotary(hidden, positions[None])
        cos, sin = cos[0, :, None, :], sin[0, :, None, :]  # [rows, 1, dim]: shared by every head
        for index, layer in enumerate(self.layers):
            q, k, v = self._before_attention(
                hidden, layer.input_norm, layer.qkv, cos, sin, self.eps, self.num_heads, self.num_kv_heads
            )
            attended = attend(batch, index, q, k, v, self.scale)
            hidden = self._after_attention(
                hidden, attended, layer.o, layer.post_norm, layer.gate_up, layer.down, self.eps
            )
        if rows is not None:
            hidden = hidden[rows]
        return F.linear(_rms_norm(hidden, self.norm, self.eps), self.lm_head).float()


def _before_attention(
    hidden: torch.Tensor,
    norm: torch.Tensor,
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    eps: float,
    num_heads: int,
    num_kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused QKV projection and RoPE: ``[rows, hidden]`` in, ``[rows, heads, dim]`` q, k, v out."""
    rows = hidden.shape[0]
    q, k, v = (
        F.linear(_rms_norm(hidden, norm, eps), qkv)
        .view(rows, num_heads + 2 * num_kv_heads, -1)
        .split([num_heads, num_kv_heads, num_kv_heads], dim=1)
    )
    return _rope(q, cos, sin), _rope(k, cos, sin), v


def _after_attention(
    hidden: torch.Tensor,
    attended: torch.Tensor,
    o: torch.Tensor,
    norm: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Output projection and residual, then the gated MLP and residual."""
    hidden = hidden + F.linear(attended.reshape(hidden.shape[0], -1), o)
    gate, up = F.linear(_rms_norm(hidden, norm, eps), gate_up).chunk(2, dim=-1)
    return hidden + F.linear(F.silu(gate) * up, down)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # As LlamaRMSNorm: normalize in float32, scale in the model's dtype.
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


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
