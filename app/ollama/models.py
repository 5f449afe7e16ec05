"""Ollama's model listings: ``/api/tags`` (every served model), ``/api/ps`` (the loaded ones) and ``/api/show``
(one model's details, context length and capabilities), each model under its name and the ``:latest`` tag Ollama's
clients add."""

from __future__ import annotations

import hashlib
from typing import Any

from app.model_pool import PoolEntry


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def listed(entry: PoolEntry, modified: str) -> dict[str, Any]:
    """One model as ``/api/tags`` lists it (no file sizes or digests of a registry: a digest of its name)."""
    name = tagged(entry.names[0])
    digest = hashlib.sha256(entry.names[0].encode()).hexdigest()
    return {"name": name, "model": name, "modified_at": modified, "size": 0, "digest": digest, "details": details()}


def running(entry: PoolEntry, modified: str, expires: str) -> dict[str, Any]:
    """A loaded model as ``/api/ps`` lists it: on the CPU (``size_vram`` 0), its context length."""
    return {**listed(entry, modified), "expires_at": expires, "size_vram": 0, "context_length": entry.max_model_len}


def details() -> dict[str, Any]:
    return {"parent_model": "", "format": "gguf", "family": "", "families": None, "parameter_size": "",
            "quantization_level": ""}  # fmt: skip


def shown(entry: PoolEntry, template: str | None, capabilities: list[str], modified: str) -> dict[str, Any]:
    """``/api/show``: the template, the context length under ``model_info``, the capabilities."""
    # Clients read ``<general.architecture>.context_length``; the architecture named is the key's, not the model's.
    info = {"general.architecture": "llama", "llama.context_length": entry.max_model_len}
    return {
        "license": "", "modelfile": f"FROM {entry.names[0]}\n", "parameters": "", "template": template or "",
        "details": details(), "model_info": info, "capabilities": capabilities, "modified_at": modified,
    }  # fmt: skip
