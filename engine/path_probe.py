"""Times each matmul path of a llama model on this CPU, by rows, at start-up (``engine/batch_mode.py`` decides).

One layer's four projections (scaled by the number of layers) and the output layer, on the model's own weights
in its dtype, on the engine's thread team: about half a second. The best of a few runs at each row count.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

from engine.batch_mode import PathTimes
from engine.model_runner import DENSE_TILE, LlamaRunner, _LlamaLayer, linear, prepack
from engine.quantized_weights import PackedParts, PackedWeight, QuantizedWeight

Weight = torch.Tensor | PackedWeight | PackedParts

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


def probe(
    model: PreTrainedModel, quantized: dict[str, QuantizedWeight] | None, max_rows: int, repeats: int = 3
) -> PathTimes:
    """Both paths' matmul seconds per step at each of ``ROWS`` up to ``max_rows`` (and ``max_rows`` itself)."""
    layer = model.model.layers[0]
    rows = tuple(sorted({r for r in ROWS if r < max_rows} | {max_rows}))
    dense_layer = LlamaRunner._fuse(layer, "model.layers.0.", {})
    dense_head = prepack(model.lm_head.weight)
    if quantized:
        invariant_layer = LlamaRunner._fuse(layer, "model.layers.0.", quantized)
        head = quantized.get("lm_head.weight")
        invariant_head = head.pack() if head is not None else dense_head
        tile = None
    else:
        invariant_layer, invariant_head, tile = dense_layer, dense_head, DENSE_TILE
    count = len(model.model.layers)
    invariant = tuple(_step_seconds(invariant_layer, invariant_head, count, r, tile, repeats, model) for r in rows)
    dense = tuple(_step_seconds(dense_layer, dense_head, count, r, None, repeats, model) for r in rows)
    return PathTimes(rows, invariant, dense, bool(quantized))


def _step_seconds(
    layer: _LlamaLayer, head: Weight, layers: int, rows: int, tile: int | None, repeats: int, model: PreTrainedModel
) -> float:
    config = model.config
    hidden = torch.randn(rows, config.hidden_size).to(model.dtype)
    wide = torch.randn(rows, config.intermediate_size).to(model.dtype)

    def layer_products() -> None:
        for weight, x in ((layer.qkv, hidden), (layer.o, hidden), (layer.gate_up, hidden), (layer.down, wide)):
            linear(x, weight, tile)

    with torch.inference_mode():
        return layers * _best(layer_products, repeats) + _best(lambda: linear(hidden, head, tile), repeats)


def _best(run: Callable[[], object], repeats: int) -> float:
    run()  # a first call packs, allocates and warms the caches
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best
