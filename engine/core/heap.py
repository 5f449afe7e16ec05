"""Handing freed heap memory back to the OS. Torch-free: the HTTP layer trims after large requests too."""

from __future__ import annotations

import contextlib
import ctypes


def trim_heap() -> None:
    """Hand freed heap memory back to the OS. glibc keeps freed blocks (the many mid-sized step tensors, a
    model freed after loading, a large request's body and its parse) in its arenas; without a trim RSS stays at
    its high-water mark. A no-op where there is no glibc."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
