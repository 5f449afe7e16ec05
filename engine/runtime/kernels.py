"""Native CPU ops, compiled from ``engine/runtime/csrc`` on first use with the compiler torch's C++ extensions use.

The build takes ~15 s once and is cached under torch's extensions directory. Where there is no compiler, or
``SMOLSERVE_NATIVE_KERNELS=0``, callers get ``None`` and fall back to torch's own operators.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).parent / "csrc" / name
    for name in (
        "decode_attention.cpp",
        "int8_attention.cpp",
        "fused_ops.cpp",
        "quant_matmul.cpp",
        "llama_layer.cpp",
        "delta_rule.cpp",
        "short_conv.cpp",
        "experts.cpp",
        "recurrent_steps.cpp",
    )
]
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@functools.cache
def native_ops() -> Any | None:
    """``torch.ops.smolserve``: ``decode_attention`` and ``write_kv`` (``csrc/decode_attention.cpp``), the 8-bit
    cache's ``decode_attention_int8`` and ``write_kv_int8`` (``csrc/int8_attention.cpp``), the fused element-wise
    ops of ``csrc/fused_ops.cpp``, ``quant_pack``, ``quant_linear`` and ``quant_rows`` (``csrc/quant_matmul.cpp``) and
    ``llama_layer`` (``csrc/llama_layer.cpp``), ``delta_rule`` and ``delta_rules`` (``csrc/delta_rule.cpp``),
    ``short_conv`` (``csrc/short_conv.cpp``), ``moe_mixture`` (``csrc/experts.cpp``), ``mamba_inputs``,
    ``mamba_output``, ``delta_inputs`` and ``delta_output`` (``csrc/recurrent_steps.cpp``); ``None`` where they
    cannot be built."""
    if os.environ.get("SMOLSERVE_NATIVE_KERNELS", "1") == "0":
        return None
    from torch.utils.cpp_extension import load

    try:
        # The name carries the CPU's identity: a build for one machine's -march=native must not be
        # loaded on another that shares the cache directory.
        name = f"smolserve_kernels_{cpu_tag()}"
        load(name=name, sources=[str(source) for source in _SOURCES], extra_cflags=_FLAGS, is_python_module=False)
    except Exception as exc:  # no compiler, no headers: the fallback is correct, only slower
        log.warning("native kernels unavailable, using torch's ops instead: %s", exc)
        return None
    log.info("native kernels ready")
    return torch.ops.smolserve


def decode_attention() -> Callable[..., torch.Tensor] | None:
    """``decode_attention(query, keys, values, lengths, scale)``: see ``csrc/decode_attention.cpp``."""
    ops = native_ops()
    return None if ops is None else ops.decode_attention


@functools.cache
def source_digest() -> str:
    """A digest of the kernels' sources and build flags: what they compute changes only with it."""
    digest = hashlib.sha256(" ".join(_FLAGS).encode())
    for source in sorted(Path(__file__).parent.joinpath("csrc").iterdir()):
        digest.update(source.name.encode() + source.read_bytes())
    return digest.hexdigest()[:16]


def cpu_tag() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        info = ""
    identity = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
    return hashlib.sha256("\n".join(identity).encode()).hexdigest()[:12]
