"""KV memory for the continuous engine, and the attention function that reads and writes it in place.

Layout. Every decoding sequence owns one *slot*: a row of one preallocated tensor per model,
``[layers, 2 (key/value), slots, kv_heads, positions, head_dim]``. Decoding sequences always fill slots
``0..n-1``, so a decode step attends over the plain view ``kv[layer, 0, :n, :, :L]`` with no gather and no
copy; each step writes only the new token's K/V at its own position. When a sequence leaves, the last slot
moves into its hole (one sequence's KV, once per departure). The tensor grows in slots and positions as
needed, amortized, and is freed when no sequence is left, so memory follows what is held.

Decode rows attend in the native kernel (``engine/csrc/decode_attention.cpp``) where it could be built,
else in torch's ``scaled_dot_product_attention``. For the kernel, keys are stored in tiles of 16 positions laid
out ``[head_dim / 2][16][2]`` (``tile_keys``), so that it scores 16 positions at once with no horizontal sums;
the tensor's shape is the same either way. Prompt rows attend in the same kernel, each as a decode row at its
position would: a row's attention is then one fixed sequence of operations, whatever else the step holds and
however its prompt was split into chunks (batch-invariant greedy decoding rests on it).

With ``kv_cache_dtype="int8"`` the same tensor holds uint8 (keys offset by 128, in tiles of 16 positions laid out
``[head_dim / 4][16][4]``; values in pairs of positions laid out ``[head_dim][2]``) and ``scales`` holds one
float32 per stored key and value; ``csrc/int8_attention.cpp`` writes and reads both.

A newcomer's prompt is prefilled into a *staging* tensor of its own (``[layers, 2, kv_heads, prompt, dim]``,
its positions rounded up to whole tiles, keys laid out as in a slot), possibly over several steps, and copied
into a slot once its prompt is complete.

Rows of one step's forward are packed into a single sequence: first one row per decoding slot, in slot
order, then each prefill chunk. ``slot_attention`` receives a ``StepBatch`` through the model's kwargs and
splits the rows back into their sequences.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from engine import kernels

ATTENTION_NAME = "smolserve_slots"

# Positions are allocated in multiples of this, so growth (a full copy) is rare.
_POSITION_BLOCK = 256
# Positions per tile of keys in the native kernel's layout; every count of positions held is a multiple of it.
KEY_TILE = 16
# What the native decode-attention kernel computes in (on the CPU).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class PrefillChunk:
    """Rows ``row : row + length`` of the step's packed input are prompt positions ``start : start + length``."""

    row: int
    start: int
    length: int
    staging: torch.Tensor  # [layers, 2, kv_heads, prompt_len, head_dim]


@dataclass(slots=True)
class StepBatch:
    """What the attention function needs to know about one step's packed rows."""

    cache: SlotKVCache
    num_decode: int
    decode_slots: torch.Tensor  # [num_decode], 0..num_decode-1
    decode_positions: torch.Tensor  # [num_decode], where each decoding row's new K/V lands
    decode_len: int  # positions attended by the decode rows: max(decode_positions) + 1
    decode_lengths: torch.Tensor  # [num_decode]: positions each decode row attends, decode_positions + 1
    # [num_decode, 1, 1, decode_len] for torch's attention; None when every row sees all of it, or the native
    # kernel (which takes decode_lengths) runs
    decode_mask: torch.Tensor | None
    chunks: list[PrefillChunk] = field(default_factory=list)


class SlotKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_cache_dtype: str = "auto",
    ) -> None:
        """``dtype`` is the model's; ``kv_cache_dtype`` ``auto`` stores K/V in it, ``int8`` in 8 bits (see
        ``csrc/int8_attention.cpp``): half the memory and reads of bfloat16, at a small cost in precision."""
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        self.kv: torch.Tensor | None = None
        # int8: one float32 scale per stored key and value, [layers, 2, slots, kv_heads, positions].
        self.scales: torch.Tensor | None = None
        self.quantized = kv_cache_dtype == "int8"
        # Built (or loaded from the build cache) now, so that no request waits for the compiler.
        native = device.type == "cpu" and dtype in _NATIVE_DTYPES and head_dim % 2 == 0
        self.native_attention = kernels.decode_attention() if native and not self.quantized else None
        self._int8_ops = _int8_ops(device, dtype, head_dim) if self.quantized else None

    @property
    def tiled_keys(self) -> bool:
        """Keys are held in the native kernel's tiles where it runs, else as torch's attention reads them."""
        return self.native_attention is not None

    @property
    def native_decode(self) -> bool:
        """Decode rows attend in a native kernel, which takes each row's length (no mask needed)."""
        return self.native_attention is not None or self.quantized

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    @property
    def bytes_per_token(self) -> int:
        per_head = self.head_dim * self.storage_dtype.itemsize + (4 if self.quantized else 0)  # + its scale
        return self.num_layers * 2 * self.num_kv_heads * per_head

    @property
    def num_slots(self) -> int:
        return 0 if self.kv is None else self.kv.shape[2]

    @property
    def num_positions(self) -> int:
        return 0 if self.kv is None else self.kv.shape[4]

    def reserve(
        self,
        num_slots: int,
        num_positions: int,
        max_slots: int,
        max_positions: int,
        max_tokens: int | None = None,
        live_slots: int | None = None,
    ) -> None:
        """Make room for ``num_slots`` slots of ``num_positions`` positions, keeping what the first
        ``live_slots`` (default: all) hold. Both grow geometrically, so that a burst of arrivals grows the
        cache a few times (each growth copies what is live: at 64 slots, 300-700 ms here), not once per handful
        of newcomers; spare slots never take the cache past ``max_tokens`` (slots x positions). With no live
        slot, storage kept from an earlier burst is reused where it fits and otherwise replaced, not copied."""
        num_positions, max_positions = _round_up(num_positions, KEY_TILE), _round_up(max_positions, KEY_TILE)
        if num_slots <= self.num_slots and num_positions <= self.num_positions:
            return
        if live_slots == 0:
            self.kv = self.scales = None  # nothing to keep: its memory can serve the new storage
        live = self.num_slots if live_slots is None else min(live_slots, self.num_slots)
        slots = self.num_slots
        if num_slots > slots:
            slots = min(max(_round_up(num_slots, 4), 2 * slots), max_slots)
        positions = self.num_positions
        if num_positions > positions:
            positions = min(_round_up(max(num_positions, positions * 5 // 4), _POSITION_BLOCK), max_positions)
        if max_tokens is not None:
            slots = min(slots, max(num_slots, self.num_slots, max_tokens // positions))
        shape = (self.num_layers, 2, slots, self.num_kv_heads, positions, self.head_dim)
        grown = zeros_in_huge_pages(shape, self.storage_dtype, self.device)
        if self.kv is not None:
            grown[:, :, :live, :, : self.num_positions] = self.kv[:, :, :live]
        if self.quantized:
            scales = torch.ones(shape[:-1], device=self.device)
            if self.scales is not None:
                scales[:, :, :live, :, : self.num_positions] = self.scales[:, :, :live]
            self.scales = scales
        self.kv = grown

    def new_staging(self, prompt_len: int) -> torch.Tensor:
        """A prompt's own KV while it is prefilled, ``[layers, 2, kv_heads, positions, dim]``; keys in the
        native kernel's tiles where it runs, as in a slot."""
        # Zeros, not whatever memory held: the positions past the prompt reach the cache with it.
        shape = (self.num_layers, 2, self.num_kv_heads, _round_up(prompt_len, KEY_TILE), self.head_dim)
        return torch.zeros(shape, dtype=self.dtype, device=self.device)

    def insert(self, slot: int, staging: torch.Tensor) -> None:
        assert self.kv is not None
        length = staging.shape[3]
        if self.quantized:
            slots = torch.full((length,), slot, device=self.device)
            positions = torch.arange(length, device=self.device)
            for layer in range(self.num_layers):
                keys, values = (staging[layer, i].transpose(0, 1) for i in range(2))  # [positions, heads, dim]
                self._write_int8(layer, slots, positions, keys, values)
            return
        self.kv[:, :, slot, :, :length] = staging  # keys already in the layout the slot holds

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store one new token's ``key`` and ``value`` (``[rows, kv_heads, dim]``) per slot, at its position."""
        assert self.kv is not None
        if self.quantized:
            self._write_int8(layer, slots, positions, key, value)
            return
        keys = self.kv[layer, 0]
        if self.tiled_keys:
            write_tiled(keys, (slots, slice(None), positions), key)
        else:
            keys[slots, :, positions] = key
        self.kv[layer, 1][slots, :, positions] = value

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy slot ``src``'s first ``length`` positions to slot ``dst`` (whole tiles of keys)."""
        assert self.kv is not None
        length = min(_round_up(length, KEY_TILE), self.num_positions)
        self.kv[:, :, dst, :, :length] = self.kv[:, :, src, :, :length]
        if self.scales is not None:
            self.scales[:, :, dst, :, :length] = self.scales[:, :, src, :, :length]

    def attend_int8(self, layer: int, query: torch.Tensor, lengths: torch.Tensor, scale: float) -> torch.Tensor:
        """Decode attention of ``query`` ``[n, kv_heads, groups, dim]`` over slots ``0..n-1`` of an int8 cache."""
        assert self.kv is not None and self.scales is not None and self._int8_ops is not None
        n = query.shape[0]
        keys, values = self.kv[layer, 0, :n], self.kv[layer, 1, :n]
        key_scales, value_scales = self.scales[layer, 0, :n], self.scales[layer, 1, :n]
        return self._int8_ops.decode_attention_int8(query, keys, values, key_scales, value_scales, lengths, scale)

    def _write_int8(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        assert self.kv is not None and self.scales is not None and self._int8_ops is not None
        kv, scales = self.kv[layer], self.scales[layer]
        self._int8_ops.write_kv_int8(kv[0], kv[1], scales[0], scales[1], slots, positions, key, value)

    def release(self) -> None:
        """Free the storage (no sequence is decoding) and hand freed heap memory back to the OS."""
        if self.kv is not None:
            self.kv = self.scales = None
            trim_heap()


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


def write_tiled(keys: torch.Tensor, where: tuple[Any, ...], key: torch.Tensor) -> None:
    """Store ``key`` into ``keys`` (``[..., positions, dim]`` in the native kernel's tiles) at ``where``: one
    index per dim of ``keys`` but the last, the last a tensor of positions. ``key`` is shaped as
    ``keys[where]`` would be in torch's indexing (the indexed rows first: ``[rows, heads, dim]``)."""
    *lead, positions, dim = keys.shape
    tiles = keys.view(*lead, positions // KEY_TILE, dim // 2, KEY_TILE, 2)
    *outer, position = where
    tiles[(*outer, position // KEY_TILE, slice(None), position % KEY_TILE)] = key.unflatten(-1, (dim // 2, 2))


def tile_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[..., positions, dim]`` (positions a multiple of 16) copied into the native kernel's tiles:
    the same shape, each 16 positions' memory laid out ``[dim / 2][16][2]``."""
    *lead, positions, dim = keys.shape
    tiles = keys.reshape(*lead, positions // KEY_TILE, KEY_TILE, dim // 2, 2).transpose(-3, -2)
    return tiles.reshape(*lead, positions, dim)


def _int8_ops(device: torch.device, dtype: torch.dtype, head_dim: int) -> Any:
    ops = kernels.native_ops() if device.type == "cpu" and dtype in _NATIVE_DTYPES else None
    if ops is None or head_dim % 4 or head_dim > 256:
        raise ValueError(
            "an int8 KV cache needs the native CPU kernels (a C++ compiler), a float32 or bfloat16 model and a "
            f"head size that is a multiple of 4 up to 256 (this one: {head_dim}, {dtype} on {device.type})"
        )
    return ops


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros`` whose memory the OS is asked to back with 2 MiB pages (``madvise``, where transparent
    huge pages are given only on request, a common default). Read in 4 KiB pages, a large cache pays a TLB
    miss and a restart of the hardware prefetcher every 4 KiB: here, the decode kernels over 8 x 2048
    positions ran 10-20% faster from huge pages."""
    nbytes = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or nbytes < 4 * _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    offset = -raw.data_ptr() % _HUGE_PAGE
    with contextlib.suppress(OSError, AttributeError):  # no glibc: ordinary pages
        libc = ctypes.CDLL("libc.so.6")
        libc.madvise(ctypes.c_void_p(raw.data_ptr() + offset), ctypes.c_size_t(nbytes), _MADV_HUGEPAGE)
    return raw[offset : offset + nbytes].view(dtype).view(shape).zero_()


def trim_heap() -> None:
    """Hand freed heap memory back to the OS. glibc keeps freed blocks (the many mid-sized step tensors, a
    model freed after loading) in its arenas; without a trim RSS stays at its high-water mark. A no-op where
    there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
