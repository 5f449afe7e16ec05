"""KV memory for the continuous engine: one pool of fixed-size blocks, and the writes into it.

Layout. One tensor per model, ``[layers, 2 (key/value), kv_heads, num_blocks * block_size, head_dim]``: per
layer and KV head, the pool's blocks of ``block_size`` positions one after another. A sequence holds the blocks
its block table lists (``engine/core/block_pool.py`` hands them out and takes them back); its position ``p`` lies at
physical position ``table[p // block_size] * block_size + p % block_size``. Each step writes every row's new K/V
at its physical position (prompt rows and decode rows alike) and the attention reads through the rows' block
tables, so no sequence's memory depends on another's length and nothing is ever moved.

Keeping each head's run of blocks contiguous means that a sequence's consecutive blocks, which a prompt's
prefill takes one after another, are one stream of memory per head, as the decode kernels like to read.

The tensor is one anonymous mapping of the whole pool (``os_memory.lazy_zeros``): the OS backs a page when it is
first written, so memory follows the blocks ever used, not the pool's size.

Where the native decode kernel runs, keys are stored in its tiles of 16 positions laid out ``[head_dim / 2][16][2]``
(written by ``write_kv`` in ``csrc/decode_attention.cpp``; ``tile_keys`` is the same layout in torch); a block is a
whole number of tiles. With ``kv_cache_dtype="int8"`` the tensor holds uint8 (keys offset by 128, in tiles of 16
positions laid out ``[head_dim / 4][16][4]``; values in pairs of positions laid out ``[head_dim][2]``) and
``scales`` one float32 per stored key and value, ``[layers, 2, kv_heads, positions]``; ``csrc/int8_attention.cpp``
writes and reads both.

The attention that reads and writes this memory is ``engine/runtime/attention.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.config import BLOCK_SIZE
from engine.core.planner import PrefillChunk
from engine.runtime import kernels, kv_disk
from engine.runtime.os_memory import forget_pages, lazy_zeros
from engine.runtime.recurrent_state import StepStates

# Positions per tile of keys in the native kernel's layout; a block is a whole number of tiles.
KEY_TILE = 16
# What the native decode-attention kernel computes in (on the CPU).
_NATIVE_DTYPES = (torch.float32, torch.bfloat16)


@dataclass(slots=True)
class StepBatch:
    """What the attention needs to know about one step's packed rows: decode rows first, then prefill chunks."""

    cache: BlockKVCache
    num_decode: int
    slots: torch.Tensor  # [rows] int64: the physical position where each row's new K/V is stored
    block_tables: torch.Tensor  # [rows, width] int32: each row's sequence's blocks
    lengths: torch.Tensor  # [rows] int64: positions each row attends, its position + 1
    chunks: list[PrefillChunk] = field(default_factory=list)
    #: A hybrid model's recurrent layers' states, as this step reads and moves them (None: no such layers).
    states: StepStates | None = None


class BlockKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        num_blocks: int,
        block_size: int = BLOCK_SIZE,
        kv_cache_dtype: str = "auto",
        layer_shapes: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """``dtype`` is the model's; ``kv_cache_dtype`` ``auto`` stores K/V in it, ``int8`` in 8 bits (see
        ``csrc/int8_attention.cpp``): half the memory and reads of bfloat16, at a small cost in precision.
        ``layer_shapes``: each layer's KV heads and head size where they differ by layer (Gemma 4's global layers);
        the layers of each shape are then one tensor of the layout above (``groups``)."""
        if block_size % KEY_TILE:
            raise ValueError(f"a block holds whole tiles of {KEY_TILE} positions, not {block_size}")
        shapes = list(layer_shapes) if layer_shapes else [(num_kv_heads, head_dim)] * num_layers
        self.num_layers = len(shapes)
        self.num_kv_heads, self.head_dim = shapes[0] if shapes else (num_kv_heads, head_dim)
        self.layer_shapes = shapes
        self.dtype = dtype
        self.device = device
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.quantized = kv_cache_dtype == "int8"
        dims = {dim for _, dim in shapes} or {head_dim}
        # Built (or loaded from the build cache) now, so that no request waits for the compiler.
        native = device.type == "cpu" and dtype in _NATIVE_DTYPES and all(dim % 2 == 0 for dim in dims)
        self.native_attention = kernels.decode_attention() if native and not self.quantized else None
        # With the native kernel, keys are in its tiles and each layer's rows are stored by one native call.
        self._native_write = kernels.native_ops().write_kv if self.native_attention is not None else None
        self._int8_ops = _int8_ops(device, dtype, max(dims)) if self.quantized else None
        positions = num_blocks * block_size
        # One tensor (and its int8 scales) for the layers of each shape, in the order the shapes first come.
        kinds = sorted(set(shapes), key=shapes.index)
        self.groups: list[tuple[torch.Tensor, torch.Tensor | None]] = [
            (
                lazy_zeros((shapes.count(kind), 2, kind[0], positions, kind[1]), self.storage_dtype, device),
                lazy_zeros((shapes.count(kind), 2, kind[0], positions), torch.float32, device) if self.quantized
                else None,
            )
            for kind in kinds
        ]  # fmt: skip
        # Each layer's place: its group's tensor and its index in it.
        places = [(kinds.index(kind), shapes[:layer].count(kind)) for layer, kind in enumerate(shapes)]
        self._place = places
        self.kv, self.scales = self.groups[0] if self.groups else (torch.empty(0), None)
        # Each layer's keys and values as views made once: indexing them anew costs ~8 small ops a layer a step.
        self._layer_kv = [(self.groups[g][0][i, 0], self.groups[g][0][i, 1]) for g, i in places]

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_cache_dtype: str,
        layer_shapes: Sequence[tuple[int, int]] | None = None,
    ) -> int:  # fmt: skip
        quantized = kv_cache_dtype == "int8"
        shapes = list(layer_shapes) if layer_shapes else [(num_kv_heads, head_dim)] * num_layers
        # (int8: + each stored key's and value's scale)
        return sum(2 * heads * (dim * (1 if quantized else dtype.itemsize) + (4 if quantized else 0))
                   for heads, dim in shapes)  # fmt: skip

    @property
    def native_decode(self) -> bool:
        """Rows attend in a native kernel that reads through block tables."""
        return self.native_attention is not None or self.quantized

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.dtype

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store each row's ``key`` and ``value`` (``[rows, kv_heads, dim]``) at its physical position ``slots``."""
        if self._int8_ops is not None:
            kv, scales = self._int8_layer(layer)
            self._int8_ops.write_kv_int8(kv[0], kv[1], scales[0], scales[1], slots, key, value)
            return
        keys, values = self._layer_kv[layer]
        if self._native_write is not None:
            self._native_write(keys, values, slots, key, value)
            return
        keys[:, slots] = key.transpose(0, 1)
        values[:, slots] = value.transpose(0, 1)

    def native_kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Layer ``layer``'s keys and values as ``write_kv`` and ``decode_attention`` take them, where those two
        native ops serve this cache (not the 8-bit one, not torch's fallback); else None."""
        return self._layer_kv[layer] if self._native_write is not None else None

    def attend(
        self, layer: int, query: torch.Tensor, batch: StepBatch, scale: float, window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Attention of ``query`` ``[rows, kv_heads, groups, dim]`` over each row's blocks (its last ``window``
        positions in a sliding-window layer; 0: all), in the native kernel; ``sinks``: each query head's attention
        sink (float32 ``[heads]``), or none."""
        keys, values = self._layer_kv[layer]
        if self._int8_ops is not None:
            _, scales = self._int8_layer(layer)
            key_scales, value_scales = scales[0], scales[1]
            return self._int8_ops.decode_attention_int8(
                query, keys, values, key_scales, value_scales, batch.block_tables, batch.lengths, self.block_size,
                scale, window, sinks,
            )  # fmt: skip
        assert self.native_attention is not None
        return self.native_attention(
            query, keys, values, batch.block_tables, batch.lengths, self.block_size, scale, window, sinks
        )

    def gather(self, layer: int, block_tables: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of positions ``0..length-1`` of each row's blocks, ``[rows, kv_heads, length, dim]``
        (untiled: torch's attention reads them where the native kernel does not run)."""
        num_blocks = -(-length // self.block_size)
        positions = block_tables[:, :num_blocks, None].long() * self.block_size + torch.arange(
            self.block_size, device=self.device
        )
        positions = positions.flatten(1)[:, :length]  # [rows, length]
        keys, values = self._layer_kv[layer]
        keys, values = keys[:, positions], values[:, positions]  # [heads, rows, length, dim]
        return keys.transpose(0, 1), values.transpose(0, 1)

    def kv_heads(self, layer: int) -> int:
        """Layer ``layer``'s KV heads."""
        return self.layer_shapes[layer][0]

    def _int8_layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``layer``'s 8-bit keys and values ``[2, heads, positions, dim]`` and their scales."""
        group, index = self._place[layer]
        kv, scales = self.groups[group]
        assert scales is not None
        return kv[index], scales[index]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block ``src``'s K/V (every layer and head) into block ``dst``: a sequence that diverges from a
        cached block partway takes its own copy of the part it shares."""
        for tensor in self._tensors():
            tensor[:, :, :, self._block(dst)] = tensor[:, :, :, self._block(src)]

    def block_bytes(self) -> int:
        """The bytes of one block: its K/V in every layer and head (and their scales, int8)."""
        return sum(t[:, :, :, :1].numel() * t.element_size() for t in self._tensors()) * self.block_size

    def read_block(self, block: int) -> torch.Tensor:
        """A copy of block ``block``'s K/V (and scales), as one run of bytes (``write_block`` takes it back)."""
        return kv_disk.to_bytes([tensor[:, :, :, self._block(block)] for tensor in self._tensors()])

    def write_block(self, block: int, data: torch.Tensor) -> None:
        """Block ``block``'s K/V (and scales) from ``data``, bytes as ``read_block`` gave them."""
        kv_disk.from_bytes(data, [tensor[:, :, :, self._block(block)] for tensor in self._tensors()])

    def release_memory(self) -> None:
        """Hand the pool's pages back to the OS (no block holds anything worth keeping); they read as zeros
        and are backed again when next written."""
        for tensor in self._tensors():
            forget_pages(tensor)

    def _tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool, each shape's K/V then its scales (int8)."""
        return [t for kv, scales in self.groups for t in (kv, scales) if t is not None]

    def _block(self, block: int) -> slice:
        return slice(block * self.block_size, (block + 1) * self.block_size)


def tile_keys(keys: torch.Tensor) -> torch.Tensor:
    """``keys`` ``[..., positions, dim]`` (positions a multiple of 16) copied into the native kernel's tiles:
    the same shape, each 16 positions' memory laid out ``[dim / 2][16][2]``."""
    *lead, positions, dim = keys.shape
    tiles = keys.reshape(*lead, positions // KEY_TILE, KEY_TILE, dim // 2, 2).transpose(-3, -2)
    return tiles.reshape(*lead, positions, dim)


def untile_keys(keys: torch.Tensor) -> torch.Tensor:
    """``tile_keys`` undone."""
    *lead, positions, dim = keys.shape
    tiles = keys.reshape(*lead, positions // KEY_TILE, dim // 2, KEY_TILE, 2).transpose(-3, -2)
    return tiles.reshape(*lead, positions, dim)


def _int8_ops(device: torch.device, dtype: torch.dtype, head_dim: int) -> Any:
    ops = kernels.native_ops() if device.type == "cpu" and dtype in _NATIVE_DTYPES else None
    if ops is None or head_dim % 4 or head_dim > 256:
        raise ValueError(
            "an int8 KV cache needs the native CPU kernels (a C++ compiler), a float32 or bfloat16 model and a "
            f"head size that is a multiple of 4 up to 256 (this one: {head_dim}, {dtype} on {device.type})"
        )
    return ops
