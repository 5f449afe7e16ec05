"""A GGUF's model config from its own ``<arch>.*`` keys, where transformers' reading of the file leaves them out:
the head size (``attention.key_length``: Qwen3's heads are not ``hidden / heads`` wide), whether the output layer
is the embedding's (no ``output.weight`` tensor), and RoPE scaling (``rope.scaling.*``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from transformers import PretrainedConfig

from engine.core.architectures import ARCHITECTURES, names
from engine.runtime.gguf_weights import architecture
from engine.runtime.quantized_weights import SUPPORTED

if TYPE_CHECKING:
    from engine.runtime.gguf_file import GGUFFile


def check(reader: GGUFFile) -> None:
    """Refuses a file whose architecture is not served natively, or that holds a tensor of a type the native
    kernels do not read (nor F32/F16/BF16, served dense), naming it and those that are."""
    arch = architecture(reader)
    if arch not in ARCHITECTURES:
        raise NotServedNatively(
            f"GGUF architecture {arch!r} is not served natively (served: {names()}); "
            "--quantization none serves it through transformers"
        )
    unread = sorted({t.tensor_type.name for t in reader.tensors} - set(SUPPORTED) - {"F32", "F16", "BF16"})
    if unread:
        raise NotServedNatively(
            f"GGUF tensor type {', '.join(unread)} is not read by the native kernels (read: "
            f"{', '.join(SUPPORTED)}, and F32/F16/BF16 served dense); --quantization none serves the file through "
            "transformers, dense"
        )


def complete(config: PretrainedConfig, reader: GGUFFile) -> PretrainedConfig:
    """``config`` (transformers' from the file) with the file's keys that it lacks."""
    arch = architecture(reader)
    def key(name: str) -> Any:
        return reader.keys.get(f"{arch}.{name}")

    if key("attention.key_length") is not None:
        config.head_dim = int(key("attention.key_length"))
    config.tie_word_embeddings = not any(tensor.name == "output.weight" for tensor in reader.tensors)
    scaling = key("rope.scaling.type")
    if scaling in ("linear", "yarn"):
        parameters = dict(getattr(config, "rope_parameters", None) or {})
        parameters.update(rope_type=scaling, factor=float(key("rope.scaling.factor")))
        if scaling == "yarn":
            parameters["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length"))
        config.rope_parameters = parameters
    return config


class NotServedNatively(ValueError):
    pass
