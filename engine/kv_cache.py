"""KV memory for the continuous engine: its layout, growth, and the writes into it.

Layout. Every decoding sequence owns one *slot*: a row of one preallocated tensor per model,
``[layers, 2 (key/value), slots, kv_heads, positions, head_dim]``. Decoding sequences always fill slots
``0..n-1``, so a decode step attends over the plain view ``kv[layer, 0, :n, :, :L]`` with no gather and no
copy; each step writes only the new token's K/V at its own position. When a sequence leaves, the last slot
moves into its hole (one sequence's KV, once per departure). The tensor grows in slots and positions as
needed, amortized, and is freed when no sequence is left, so memory follows what is held. Where the native
decode kernel runs, keys are stored in its tiles of 16 positions laid out ``[head_dim / 2][16][2]``
(``write_tiled``, ``tile_keys``); the tensor's shape is the same either way.

With ``kv_cache_dtype="int8"`` the same tensor holds uint8 (keys offset by 128, in tiles of 16 positions laid out
``[head_dim / 4][16][4]``; values in pairs of positions laid out ``[head_dim][2]``) and ``scales`` holds one
float32 per stored key and value; ``csrc/int8_attention.cpp`` writes and reads both.

A newcomer's prompt is prefilled into a *staging* tensor of its own (``[layers, 2, kv_heads, prompt, dim]``,
its positions rounded up to whole tiles, keys laid out as in a slot), possibly over several steps, and copied
into a slot once its prompt is complete.

The attention that reads and writes this memory is ``engine/attention.py``; the OS memory calls are
``engine/os_memory.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine import kernels
from engine.os_memory import trim_heap, zeros_in_huge_pages

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


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
