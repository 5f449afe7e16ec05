"""A GGUF file's tensors and scalar keys, read without building its vocabulary. gguf-py's ``GGUFReader`` makes a
numpy view of every field, the ~300k token strings and merges of a Qwen file among them: ~6 s of a start. The
loader needs the tensors and a few keys; the tokenizer is transformers' conversion, read once and cached."""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_DTYPES = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
           GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
           GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Tensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # innermost first, as GGUF lists dimensions
    #: The stored values (a view of the mapped file): [..., outer, inner] in the type's dtype, or, for a quantized
    #: type (and BF16), uint8 [..., outer, bytes of a row].
    data: np.ndarray


class GGUFFile:
    """``keys``: every key whose value is not a long array (a vocabulary's are skipped over; arrays of up to
    ``_SHORT_ARRAY`` numbers, per-layer values, are lists);
    ``tensors``: in the file's order."""

    def __init__(self, path: Path | str) -> None:
        self._map = np.memmap(path, mode="r")
        buffer = memoryview(self._map)
        if bytes(buffer[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        self._at = 8  # magic, version
        num_tensors, num_keys = self._unpack("<QQ")
        self.keys: dict[str, Any] = {}
        for _ in range(num_keys):
            name = self._string()
            value = self._value(self._unpack("<I")[0])
            if value is not _SKIPPED:
                self.keys[name] = value
        infos = [self._tensor_info() for _ in range(num_tensors)]
        alignment = int(self.keys.get("general.alignment", 32))
        start = -(-self._at // alignment) * alignment
        #: Where the tensors' data begins: every byte before it is the file's description (keys, tensor infos).
        self.data_start = start
        self.tensors = [self._tensor(name, dims, kind, start + offset) for name, dims, kind, offset in infos]

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._map, self._at)
        self._at += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._map[self._at : self._at + length]).decode("utf-8", errors="replace")
        self._at += length
        return text

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item == _STRING:
                for _ in range(count):  # each string's length is read to step over it
                    (length,) = struct.unpack_from("<Q", self._map, self._at)
                    self._at += 8 + length
            elif item in _SCALARS and count <= _SHORT_ARRAY:  # per-layer values (e.g. which layers slide)
                return list(self._unpack(f"<{count}{_SCALARS[item][1:]}"))
            elif item in _SCALARS:
                self._at += struct.calcsize(_SCALARS[item]) * count
            else:
                for _ in range(count):
                    self._value(item)
            return _SKIPPED
        return self._unpack(_SCALARS[kind])[0]

    def _tensor_info(self) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        dims = self._unpack(f"<{num_dims}Q")
        kind, offset = self._unpack("<IQ")
        return name, tuple(int(d) for d in dims), GGMLQuantizationType(kind), int(offset)

    def _tensor(self, name: str, dims: tuple[int, ...], kind: GGMLQuantizationType, at: int) -> Tensor:
        outer = tuple(reversed(dims[1:]))
        if kind in _DTYPES:
            dtype = np.dtype(_DTYPES[kind])
            count = int(np.prod(dims))
            data = self._map[at : at + count * dtype.itemsize].view(dtype).reshape(*outer, dims[0])
        else:
            weights, size = GGML_QUANT_SIZES[kind]
            row = dims[0] // weights * size
            data = self._map[at : at + row * int(np.prod(outer, dtype=np.int64))].reshape(*outer, row)
        return Tensor(name, kind, dims, data)


_SKIPPED = object()
_SHORT_ARRAY = 1024
