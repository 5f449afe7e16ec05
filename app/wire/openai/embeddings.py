"""The wire format of ``/v1/embeddings``: its body (``input`` a string, strings, token ids or lists of them;
``encoding_format`` float or base64 of little-endian float32; ``dimensions``; vLLM's ``truncate_prompt_tokens``) and
the list it answers with."""

from __future__ import annotations

import base64
import struct
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from app.wire.openai.errors import bad_request
from app.wire.openai.request import WireModel, is_token, validated


class EmbeddingsBody(WireModel):
    model_config = ConfigDict(strict=True, frozen=True, extra="allow")  # ``user`` and other keys: ignored

    model: str | None = None
    input: Any = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Field(ge=1)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None  # vLLM's: -1 is the model's limit


@dataclass(slots=True, frozen=True)
class EmbeddingsRequest:
    model: str | None
    inputs: list[str | list[int]]
    base64: bool
    dimensions: int | None
    truncate: int | None


def parse_embeddings_request(body: dict[str, Any], max_inputs: int) -> EmbeddingsRequest:
    req: EmbeddingsBody = validated(EmbeddingsBody, body)
    inputs = _inputs(req.input)
    if len(inputs) > max_inputs:
        raise bad_request(f"input has {len(inputs)} items; at most {max_inputs} are accepted per request", "input")
    return EmbeddingsRequest(
        req.model, inputs, req.encoding_format == "base64", req.dimensions, req.truncate_prompt_tokens
    )


def _inputs(value: Any) -> list[str | list[int]]:
    """A string, a list of strings, a list of token ids, or a list of token-id lists: as a list of inputs."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(is_token(t) for t in value)):
        inputs: list[Any] = [value]  # one text, or one input of token ids
    elif isinstance(value, list) and value and _all_of(value, (str, list)):
        inputs = value
    else:
        raise bad_request("input must be a string, a list of strings, or a list of token ids (or of lists)", "input")
    for index, item in enumerate(inputs):
        param = "input" if len(inputs) == 1 else f"input[{index}]"
        if not item:
            raise bad_request(f"{param} must not be empty", param)
        if isinstance(item, list) and not all(is_token(t) for t in item):
            raise bad_request(f"{param}: token ids must be non-negative integers", param)
    return inputs


def embedding_list(model: str, vectors: list[list[float]], as_base64: bool, prompt_tokens: int) -> dict[str, Any]:
    data = [
        {"object": "embedding", "index": index, "embedding": _base64(vector) if as_base64 else vector}
        for index, vector in enumerate(vectors)
    ]
    usage = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


def _base64(vector: list[float]) -> str:
    """Little-endian float32, as the openai SDK decodes it (``numpy.frombuffer(..., dtype="float32")``)."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _all_of(values: list[Any], kinds: tuple[type, ...]) -> bool:
    """Every value of one of ``kinds`` (all strings, or all lists)."""
    return any(all(isinstance(value, kind) for value in values) for kind in kinds)
