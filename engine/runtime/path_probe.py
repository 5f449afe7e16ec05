"""Times each matmul path of a llama model on this CPU, by rows, at start-up (``engine/core/batch_mode.py`` decides).

One layer's four projections (scaled by the number of layers) and the output layer, on the model's own weights
in its dtype, on the engine's thread team: ~2 s. The best of three runs at each row count, the paths in turn.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from engine.core.architectures import by_model_type
from engine.core.batch_mode import PathTimes
from engine.runtime.model_runner import DENSE_TILE, LlamaRunner, _LlamaLayer, linear, prepack
from engine.runtime.quantized_weights import PackedParts, PackedWeight, QuantizedWeight

Weight = torch.Tensor | PackedWeight | PackedParts

#: Row counts timed: few rows closely, for speculative decoding's row budget (``engine/core/speculation.py``).
ROWS = (1, 2, 4, 6, 8, 16, 32, 64, 128, 256)


def probed(model: PreTrainedModel) -> tuple[str, str]:
    """The weights the probe multiplies, by the start of their names (their dense values must be there): the first
    attention layer's (a hybrid's first layers may be convolutions) and the output layer's."""
    return f"model.layers.{_attention_layer(model)}.", "lm_head."


def _attention_layer(model: PreTrainedModel) -> int:
    return next(i for i, layer in enumerate(model.model.layers) if getattr(layer, "self_attn", None) is not None)


def probe(
    model: PreTrainedModel, quantized: dict[str, QuantizedWeight] | None, max_rows: int, repeats: int = 3
) -> PathTimes:
    """Both paths' matmul seconds per step at each of ``ROWS`` up to ``max_rows`` (and ``max_rows`` itself)."""
    index = _attention_layer(model)
    layer, prefix = model.model.layers[index], f"model.layers.{index}."
    arch = by_model_type(model.config.model_type)
    assert arch is not None
    rows = tuple(sorted({r for r in ROWS if r < max_rows} | {max_rows}))
    dense = Path(LlamaRunner._fuse(layer, prefix, {}, arch), prepack(model.lm_head.weight), None)
    if quantized:
        head = quantized.get("lm_head.weight")
        invariant = Path(LlamaRunner._fuse(layer, prefix, quantized, arch), head.pack() if head else dense.head, None)
    else:
        invariant = Path(dense.layer, dense.head, DENSE_TILE)
    times = [_seconds((invariant, dense), r, repeats, model) for r in rows]
    return PathTimes(rows, tuple(t[0] for t in times), tuple(t[1] for t in times), bool(quantized))


@dataclass(slots=True)
class Path:
    layer: _LlamaLayer
    head: Weight
    tile: int | None


def _seconds(paths: tuple[Path, ...], rows: int, repeats: int, model: PreTrainedModel) -> list[float]:
    """Each path's best time over ``repeats``, their runs interleaved so that all see the same machine (a
    neighbour that comes or goes during the probe slows both)."""
    config = model.config
    hidden = torch.randn(rows, config.hidden_size).to(model.dtype)
    # The output projection's input is the heads side by side: wider than the hidden size where heads are (qwen3).
    arch = by_model_type(config.model_type)
    assert arch is not None
    output = model.model.layers[_attention_layer(model)].get_submodule(arch.name("self_attn.o_proj"))
    attended = torch.randn(rows, output.in_features).to(model.dtype)
    wide = torch.randn(rows, config.intermediate_size).to(model.dtype)
    layers = len(model.model.layers)

    def products(path: Path) -> None:
        layer = path.layer
        for weight, x in ((layer.qkv, hidden), (layer.o, attended), (layer.gate_up, hidden), (layer.down, wide)):
            linear(x, weight, path.tile)

    def step(path: Path) -> float:
        began = time.perf_counter()
        products(path)
        middle = time.perf_counter()
        linear(hidden, path.head, path.tile)
        return layers * (middle - began) + time.perf_counter() - middle

    best = [float("inf")] * len(paths)
    with torch.inference_mode():
        for path in paths:
            step(path)  # a first call packs, allocates and warms the caches
        for _ in range(repeats):
            for i, path in enumerate(paths):
                best[i] = min(best[i], step(path))
    return best
