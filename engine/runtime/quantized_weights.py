"""Weight matrices in quantized blocks, as the native matmul (``csrc/quant_matmul.cpp``) reads them.

``QuantizedWeight`` is a matrix in GGML's block layout: read from a GGUF file (``engine/runtime/gguf_weights.py``), or
made at load from a dense model's weights (``int8_weights``, ``--quantization int8``). ``PackedWeight`` is the same
blocks regrouped once for the kernel (8 rows side by side) and multiplies activations; ``PackedParts`` several of
them as one fused projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: GGML type numbers the native matmul reads (``csrc/quant_matmul.cpp``).
SUPPORTED = {
    "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14,
    "IQ4_NL": 20, "IQ4_XS": 23, "MXFP4": 39,
}  # fmt: skip


@dataclass(slots=True, frozen=True)
class QuantizedWeight:
    """A ``[out, in]`` weight matrix as GGML blocks: ``data`` uint8 ``[out, bytes per row]``, of type ``qtype``."""

    data: torch.Tensor
    qtype: int
    in_features: int

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    def pack(self) -> PackedWeight:
        """The blocks regrouped as the native matmul reads them (``quant_pack``: 8 rows' blocks side by side)."""
        from engine.runtime import kernels

        ops = kernels.native_ops()
        if ops is None:
            raise ValueError("quantized weights need the native CPU kernels (a C++ compiler)")
        return PackedWeight(ops.quant_pack(self.data, self.qtype), self.qtype, self.in_features, self.out_features)

    @staticmethod
    def stack(weights: list[QuantizedWeight]) -> QuantizedWeight | None:
        """The matrices one above the other (a fused projection); None unless all share a type and input size."""
        first = weights[0]
        if any(w.qtype != first.qtype or w.in_features != first.in_features for w in weights):
            return None
        return QuantizedWeight(torch.cat([w.data for w in weights]), first.qtype, first.in_features)


@dataclass(slots=True, frozen=True)
class PackedWeight:
    """A ``QuantizedWeight`` in the native matmul's layout: ``data`` uint8 ``[ceil(out / 8), group bytes]``, each
    group the blocks of 8 rows side by side (``csrc/quant_matmul.cpp``)."""

    data: torch.Tensor
    qtype: int
    in_features: int
    out_features: int

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for ``x`` ``[rows, in]``."""
        from engine.runtime import kernels

        return kernels.native_ops().quant_linear(x, self.data, self.qtype, self.out_features)

    def rows(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``index`` dequantized to ``dtype``, ``[len(index), in]`` (an embedding lookup): each weight as
        GGUF's own dequantization computes it, ``d * q`` (``+ m`` for the 4-bit types)."""
        from engine.runtime import kernels

        return kernels.native_ops().quant_rows(self.data, self.qtype, index).to(dtype)


@dataclass(slots=True, frozen=True)
class PackedParts:
    """Matrices stacked in a fused projection whose types differ (a Q4_K_M file's Q6_K value rows under Q4_K
    query and key rows): each multiplied in its own blocks, the outputs side by side."""

    parts: tuple[PackedWeight, ...]

    @property
    def out_features(self) -> int:
        return sum(part.out_features for part in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part.matmul(x) for part in self.parts], dim=1)


def int8_weight(weight: torch.Tensor) -> QuantizedWeight:
    """``weight`` ``[out, in]`` quantized per output channel: each row's int8 values ``round(w / s)`` with one
    scale ``s = max|w| / 127`` (as fp16) for the row, in Q8_0 blocks that all carry their row's scale."""
    dense = weight.detach().float()
    out, inp = dense.shape
    if inp % 32:
        raise ValueError(f"int8 weights need an input size that is a multiple of 32, not {inp}")
    scale = (dense.abs().amax(dim=1) / 127).to(torch.float16)
    divisor = torch.where(scale > 0, scale.float(), torch.ones(()))[:, None]
    values = (dense / divisor).round().clamp(-127, 127).to(torch.int8)
    blocks = torch.empty(out, inp // 32, 34, dtype=torch.uint8)
    blocks[..., :2] = scale.view(torch.uint8).view(out, 1, 2)
    blocks[..., 2:] = values.view(torch.uint8).view(out, -1, 32)
    return QuantizedWeight(blocks.view(out, -1), SUPPORTED["Q8_0"], inp)


def int8_weights(model: torch.nn.Module) -> dict[str, QuantizedWeight]:
    """Every linear layer of ``model`` whose input size the blocks fit, as ``int8_weight``, by parameter name."""
    return {
        f"{name}.weight": int8_weight(module.weight)
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0
    }
