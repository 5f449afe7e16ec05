"""The model architectures served natively, one row each: what sets each apart from a llama, as the runner
(``engine/runtime/model_runner.py``), the GGUF reader (``engine/runtime/gguf_weights.py``, ``gguf_config.py``) and
the loader read it. A new architecture of the llama family is a new row here. No torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    #: ``general.architecture`` in a GGUF file.
    gguf: str
    #: transformers' ``model_type``.
    model_type: str
    #: llama.cpp's converter stores the query and key rows permuted for its RoPE (llama only): put back at load.
    permuted_qk: bool = False
    #: The query, key and value projections add a bias (not the output one).
    qkv_bias: bool = False
    #: Each query and key head is RMS-normalized (its own weights, over the head's dimension) before RoPE.
    qk_norm: bool = False


ARCHITECTURES = {
    arch.gguf: arch
    for arch in (
        Architecture("llama", "llama", permuted_qk=True),  # Llama 2/3.x, SmolLM, Mistral-style files
        Architecture("qwen2", "qwen2", qkv_bias=True),  # Qwen2, Qwen2.5 (Coder), tied or separate output
        Architecture("qwen3", "qwen3", qk_norm=True),  # Qwen3 dense
    )
}
_BY_MODEL_TYPE = {arch.model_type: arch for arch in ARCHITECTURES.values()}


class NotServedNatively(ValueError):
    """A model file this server refuses to serve from its blocks (its architecture, or a tensor type the native
    kernels do not read); the message names it and what is served."""


def by_model_type(model_type: str) -> Architecture | None:
    """The row of transformers' ``model_type`` (None: not served natively)."""
    return _BY_MODEL_TYPE.get(model_type)


def names() -> str:
    """The natively served architectures, as GGUF files name them, for messages."""
    return ", ".join(ARCHITECTURES)
