"""Attention over one step's packed rows, reading and writing the KV memory of ``engine/kv_cache.py`` in place.

Decode rows attend in the native kernel (``engine/csrc/decode_attention.cpp``) where it could be built,
else in torch's ``scaled_dot_product_attention``. For the kernel, keys are stored in tiles of 16 positions laid
out ``[head_dim / 2][16][2]`` (``tile_keys``), so that it scores 16 positions at once with no horizontal sums;
the tensor's shape is the same either way. Prompt rows attend in the same kernel, each as a decode row at its
position would: a row's attention is then one fixed sequence of operations, whatever else the step holds and
however its prompt was split into chunks (batch-invariant greedy decoding rests on it).

Rows of one step's forward are packed into a single sequence: first one row per decoding slot, in slot
order, then each prefill chunk. ``slot_attention`` receives a ``StepBatch`` through the model's kwargs and
splits the rows back into their sequences.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kv_cache import PrefillChunk, StepBatch, write_tiled

ATTENTION_NAME = "smolserve_slots"


def attend(
    batch: StepBatch, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None
) -> torch.Tensor:
    """Attention over one step's packed rows: ``query`` ``[rows, heads, dim]``, ``key``/``value``
    ``[rows, kv_heads, dim]`` (after RoPE). Writes the rows' K/V into the cache; returns ``[rows, heads, dim]``."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    if not batch.chunks:
        return _decode_attention(batch, layer, query, key, value, scale)
    out = torch.empty_like(query)
    n = batch.num_decode
    if n:
        out[:n] = _decode_attention(batch, layer, query[:n], key[:n], value[:n], scale)
    for chunk in batch.chunks:
        rows = slice(chunk.row, chunk.row + chunk.length)
        out[rows] = _prefill_attention(batch, chunk, layer, query[rows], key[rows], value[rows], scale)
    return out


def slot_attention(
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
    return attend(batch, module.layer_idx, *rows_first, scaling).unsqueeze(0), None


def _decode_attention(
    batch: StepBatch, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """One new token per slot, attending over its slot's positions ``0..position``."""
    n = batch.num_decode
    kv = batch.cache.kv
    assert kv is not None
    num_heads, num_kv_heads = query.shape[1], key.shape[1]
    batch.cache.write(layer, batch.decode_slots, batch.decode_positions, key, value)
    # Grouped-query attention without repeating K/V: the query heads that share a KV head become that
    # head's "query length", which is free for a single new token per row.
    q = query.reshape(n, num_kv_heads, num_heads // num_kv_heads, -1)
    native = batch.cache.native_attention
    if batch.cache.quantized:
        return batch.cache.attend_int8(layer, q, batch.decode_lengths, scale).reshape(n, num_heads, -1)
    if native is not None:
        return native(q, kv[layer, 0, :n], kv[layer, 1, :n], batch.decode_lengths, scale).reshape(n, num_heads, -1)
    keys = kv[layer, 0, :n, :, : batch.decode_len]
    values = kv[layer, 1, :n, :, : batch.decode_len]
    attended = F.scaled_dot_product_attention(q, keys, values, attn_mask=batch.decode_mask, scale=scale)
    return attended.reshape(n, num_heads, -1)


def _prefill_attention(
    batch: StepBatch,
    chunk: PrefillChunk,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A chunk of prompt rows, attending causally over the prompt so far (its staging tensor).

    Where the native kernel runs, each prompt row is attended exactly as a decode row at that position would
    be (the same kernel, the same order of every sum), so a prompt's rows come out the same however it is
    split into chunks and whatever shares its steps, and the same as if its tokens had been decoded one by
    one. Elsewhere torch's attention runs over the chunk."""
    end = chunk.start + chunk.length
    native = batch.cache.native_attention
    keys, values = chunk.staging[layer, 0], chunk.staging[layer, 1]  # [kv_heads, positions, dim]
    values[:, chunk.start : end] = value.transpose(0, 1)
    if native is not None:
        write_tiled(keys, (slice(None), torch.arange(chunk.start, end, device=key.device)), key)
        rows, num_kv_heads = query.shape[0], key.shape[1]
        q = query.reshape(rows, num_kv_heads, query.shape[1] // num_kv_heads, -1)
        lengths = torch.arange(chunk.start + 1, end + 1, device=query.device)
        shared = (rows, *keys.shape)  # every row reads the same staging: a stride-0 view, no copy
        attended = native(q, keys.expand(shared), values.expand(shared), lengths, scale)
        return attended.reshape(rows, query.shape[1], -1)
    keys[:, chunk.start : end] = key.transpose(0, 1)
    q = query.transpose(0, 1)
    if chunk.start == 0:
        attended = F.scaled_dot_product_attention(
            q, keys[:, :end], values[:, :end], is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        # Row i sits at prompt position start + i and sees positions 0..start + i.
        positions = torch.arange(end, device=q.device)
        mask = positions[None, :] <= positions[chunk.start :, None]
        attended = F.scaled_dot_product_attention(
            q, keys[:, :end], values[:, :end], attn_mask=mask, scale=scale, enable_gqa=True
        )
    return attended.transpose(0, 1)
