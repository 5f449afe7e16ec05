"""Attention over one step's packed rows, reading and writing the block KV memory of ``engine/runtime/kv_cache.py``.

Every row of a step, a decoding sequence's new token or a prompt position of a prefill chunk, first stores its
K/V at its physical position, then attends over its sequence's positions ``0..position`` through the sequence's
block table. Where the native kernel could be built (``engine/runtime/csrc/decode_attention.cpp``, or the 8-bit cache's
``int8_attention.cpp``) all rows attend in one call of it, prompt rows exactly as decode rows: a row's attention
is then one fixed sequence of operations, whatever else the step holds, however its prompt was split into chunks
and whether its prefix came from the prefix cache (batch-invariant greedy decoding rests on it). Elsewhere torch's
``scaled_dot_product_attention`` runs over K/V gathered from the blocks.

Rows of one step's forward are packed into a single sequence: first one row per decoding sequence, then each
prefill chunk. ``block_attention`` receives a ``StepBatch`` through the model's kwargs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.core.planner import PrefillChunk
from engine.runtime.kv_cache import StepBatch

ATTENTION_NAME = "smolserve_blocks"


def attend(
    batch: StepBatch, layer: int, query: torch.Tensor, key: torch.Tensor | None, value: torch.Tensor | None,
    scale: float | None, window: int = 0, sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention over one step's packed rows: ``query`` ``[rows, heads, dim]``, ``key``/``value``
    ``[rows, kv_heads, dim]`` (after RoPE). Writes the rows' K/V into the cache; returns ``[rows, heads, dim]``.
    ``key`` and ``value`` None: the rows' K/V are in the cache already (an earlier layer of the step wrote them
    there: Gemma 4's KV-sharing layers read them).
    ``window`` > 0: a sliding-window layer, each row attending only its last ``window`` positions (itself included).
    ``sinks`` ``[heads]``: each head's attention sink (gpt-oss), a logit that takes its share of the softmax's
    weight and adds no value."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    cache = batch.cache
    if key is not None and value is not None:
        cache.write(layer, batch.slots, key, value)
    rows, num_heads, num_kv_heads = query.shape[0], query.shape[1], cache.kv_heads(layer)
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that head's
    # "query length", which is free for a single query row.
    q = query.reshape(rows, num_kv_heads, num_heads // num_kv_heads, -1)
    if cache.native_decode:
        sinks = None if sinks is None else sinks.float()
        return cache.attend(layer, q, batch, scale, window, sinks).reshape(rows, num_heads, -1)
    out = torch.empty_like(query)
    n = batch.num_decode
    if n:
        out[:n] = _decode_rows(batch, layer, q[:n], scale, window, sinks).reshape(n, num_heads, -1)
    for chunk in batch.chunks:
        rows_of = slice(chunk.row, chunk.row + chunk.length)
        out[rows_of] = _chunk_rows(batch, chunk, layer, query[rows_of], scale, window, sinks)
    return out


def block_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """``attend`` as a transformers attention function, registered as ``ATTENTION_NAME``.

    transformers passes ``[1, heads, rows, dim]`` and expects ``[1, rows, heads, dim]`` back.
    """
    batch = kwargs["step_batch"]
    assert isinstance(batch, StepBatch)
    rows_first = (t[0].transpose(0, 1) for t in (query, key, value))
    window = kwargs.get("sliding_window") or 0  # transformers passes a sliding-window layer's window
    assert isinstance(window, int)
    sinks = kwargs.get("s_aux")  # ... and gpt-oss's attention sinks
    assert sinks is None or isinstance(sinks, torch.Tensor)
    return attend(batch, module.layer_idx, *rows_first, scaling, window, sinks).unsqueeze(0), None


def _decode_rows(
    batch: StepBatch, layer: int, q: torch.Tensor, scale: float, window: int, sinks: torch.Tensor | None
) -> torch.Tensor:
    """Torch's attention for the decode rows ``q`` ``[n, kv_heads, groups, dim]``, each over its own length."""
    n = batch.num_decode
    lengths = batch.lengths[:n]
    longest = int(lengths.max())
    keys, values = batch.cache.gather(layer, batch.block_tables[:n], longest)
    mask = None
    if window or int(lengths.min()) != longest:
        positions = torch.arange(longest, device=q.device)[None, :]
        mask = (positions < lengths[:, None]) & (positions >= lengths[:, None] - window if window else True)
        mask = mask[:, None, None, :]
    if sinks is not None:
        return _with_sinks(q, keys, values, mask, scale, sinks.view(q.shape[1], q.shape[2], 1))
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def _chunk_rows(
    batch: StepBatch, chunk: PrefillChunk, layer: int, query: torch.Tensor, scale: float, window: int,
    sinks: torch.Tensor | None,
) -> torch.Tensor:  # fmt: skip
    """Torch's attention for one prefill chunk's rows, causally over its sequence's positions so far."""
    end = chunk.start + chunk.length
    keys, values = batch.cache.gather(layer, batch.block_tables[chunk.row : chunk.row + 1], end)
    q = query.transpose(0, 1)[None]  # [1, heads, rows, dim]
    positions = torch.arange(end, device=q.device)
    mask = positions[None, :] <= positions[chunk.start :, None]  # row i sits at start + i
    if window:
        mask &= positions[None, :] > positions[chunk.start :, None] - window
    if sinks is not None:
        groups = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        attended = _with_sinks(q, keys, values, mask, scale, sinks.view(-1, 1, 1))
    else:
        attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return attended[0].transpose(0, 1)


def _with_sinks(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None, scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Attention whose softmax has one more logit per head, its sink (``sinks`` broadcast over the scores' rows), that
    takes weight and adds no value: as transformers' gpt-oss computes it."""
    scores = (q.float() @ keys.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().expand(*scores.shape[:-1], 1)
    weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return (weights @ values.float()).to(q.dtype)
