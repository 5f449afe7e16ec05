"""Ollama's model listings: ``/api/tags`` (every served model), ``/api/ps`` (the loaded ones) and ``/api/show``
(one model's details, context length and capabilities), each model under its name and the ``:latest`` tag Ollama's
clients add."""

from __future__ import annotations

import hashlib
from typing import Any

from app.services.model_pool import PoolEntry
from app.stores.model_aliases import Alias


def tagged(name: str) -> str:
    return name if ":" in name else f"{name}:latest"


def listed(entry: PoolEntry, modified: str, facts: dict[str, Any], alias: Alias | None = None) -> dict[str, Any]:
    """One model as ``/api/tags`` lists it (no file sizes or digests of a registry: a digest of its name);
    ``facts``: what its engine says of it (``runtime_info``'s ``model``; empty while it is not loaded); ``alias``: a
    model made from it (``/api/create``), listed under its own name with the served one as its parent."""
    own = alias.name if alias is not None else entry.names[0]
    name = tagged(own)
    digest = hashlib.sha256(own.encode()).hexdigest()
    info = details(facts)
    if alias is not None:
        info["parent_model"] = tagged(alias.target)
    return {"name": name, "model": name, "modified_at": modified, "size": 0, "digest": digest, "details": info}


def running(entry: PoolEntry, modified: str, expires: str, facts: dict[str, Any]) -> dict[str, Any]:
    """A loaded model as ``/api/ps`` lists it: on the CPU (``size_vram`` 0), its context length."""
    return {**listed(entry, modified, facts), "expires_at": expires, "size_vram": 0,
            "context_length": entry.max_model_len}  # fmt: skip


def details(facts: dict[str, Any]) -> dict[str, Any]:
    """Ollama's ``details``: the architecture as the family, the parameter count as "135.0M" / "7.6B", the block
    types as the quantization level ("F32" for a dense model)."""
    family = facts.get("architecture", "")
    count = facts.get("parameters")
    size = "" if not count else f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
    level = "/".join(facts.get("block_types") or []) or ("F32" if facts else "")
    return {"parent_model": "", "format": "gguf", "family": family, "families": [family] if family else None,
            "parameter_size": size, "quantization_level": level}  # fmt: skip


def shown(entry: PoolEntry, template: str | None, capabilities: list[str], modified: str,
          facts: dict[str, Any], alias: Alias | None = None) -> dict[str, Any]:  # fmt: skip
    """``/api/show``: the template, the GGUF's keys under ``model_info`` (the served context length as
    ``<arch>.context_length``), the capabilities; for a model made by ``/api/create`` (``alias``), its Modelfile,
    parameters, system prompt, messages and license."""
    arch = facts.get("architecture") or "llama"  # clients read ``<general.architecture>.context_length``
    # The file's own keys (a vocabulary's long arrays left out), with the context this server serves it at.
    info = {**facts.get("file_keys", {}), "general.architecture": arch, f"{arch}.context_length": entry.max_model_len,
            "general.parameter_count": facts.get("parameters")}  # fmt: skip
    answer = {
        "license": "", "modelfile": f"FROM {entry.names[0]}\n", "parameters": "", "template": template or "",
        "details": details(facts), "model_info": info, "capabilities": capabilities, "modified_at": modified,
    }  # fmt: skip
    if alias is not None:
        answer.update(license=alias.license, modelfile=alias.modelfile(), parameters=alias.parameter_text(),
                      system=alias.system or "", messages=alias.messages)  # fmt: skip
        answer["details"]["parent_model"] = tagged(alias.target)
    return answer
