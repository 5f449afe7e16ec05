"""Ollama's ``/api/create``, ``/api/copy`` and ``/api/delete`` bodies (``ollama/api/types.go``): a new model ``from``
a served one with its own ``parameters`` (Ollama's options), ``system`` prompt, opening ``messages`` and ``license``,
given as fields or as an older client's ``modelfile`` text (``FROM``, ``PARAMETER``, ``SYSTEM``, ``MESSAGE``,
``LICENSE``). What needs a model store this server does not have (``files``, ``adapters``, ``quantize``, a
``template`` of its own) is a 400 naming it, as is any field Ollama does not define."""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from app.stores.model_aliases import Alias
from app.wire.ollama.request import model_name
from app.wire.openai.errors import bad_request

#: Fields of ``/api/create`` that need weights, templates or quantization of a model store.
_STORE_FIELDS = {
    "files": "files: models come from local files (--model, --models-dir); a new model is made from a served one",
    "adapters": "adapters: LoRA adapters are not served",
    "quantize": "quantize: a model is served in its file's own blocks", "quantization": "quantization: as quantize",
    "template": "template: the model's own chat template is used", "path": "path: models come from local files",
    "renderer": "renderer: the model's own chat template is used", "parser": "parser: the model family's own is used",
    "info": "info: not kept",
}  # fmt: skip
_CREATE_FIELDS = {"model", "name", "from", "stream", "system", "parameters", "messages", "license", "modelfile"}
#: A Modelfile's instructions this server refuses, and why.
_REFUSED_LINES = {"TEMPLATE": "TEMPLATE: the model's own chat template is used",
                  "ADAPTER": "ADAPTER: LoRA adapters are not served", "REQUIRES": "REQUIRES: not checked"}  # fmt: skip
#: The most messages a made model opens every conversation with.
MAX_MESSAGES = 64


def creation(body: dict[str, Any]) -> Alias:
    """The model ``/api/create`` asks for, its ``target`` the model it is made from as the body names it (a served
    model, or one made before: ``app/api/ollama_models.py`` resolves it)."""
    unknown = sorted(set(body) - _CREATE_FIELDS - set(_STORE_FIELDS))
    if unknown:
        raise bad_request(f"{unknown[0]}: not a field of /api/create", unknown[0])
    for name, why in _STORE_FIELDS.items():
        if body.get(name):
            raise bad_request(why, name)
    name = model_name({"model": body.get("model") or body.get("name")})
    made: dict[str, Any] = _from_modelfile(body["modelfile"]) if body.get("modelfile") else {}
    source = body.get("from") or made.get("target")
    if not isinstance(source, str) or not source:
        raise bad_request("from: the served model (or one made before) the new one answers with", "from")
    return Alias(
        name, source.removesuffix(":latest"), {**made.get("parameters", {}), **_parameters(body.get("parameters"))},
        _text(body.get("system"), "system") or made.get("system"),
        [*made.get("messages", []), *_messages(body.get("messages"))],
        _license(body.get("license")) or made.get("license", ""),
    )  # fmt: skip


def copied(body: dict[str, Any]) -> tuple[str, str]:
    """``/api/copy``'s source and destination."""
    names = []
    for key in ("source", "destination"):
        value = body.get(key)
        if not isinstance(value, str) or not value:
            raise bad_request(f"{key} is required", key)
        names.append(value.removesuffix(":latest"))
    return names[0], names[1]


def _parameters(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("parameters must be an object of Ollama's options", "parameters")
    return dict(value)


def _text(value: Any, param: str) -> str | None:
    if value is None or isinstance(value, str):
        return value or None
    raise bad_request(f"{param} must be a string", param)


def _license(value: Any) -> str:
    if isinstance(value, list) and all(isinstance(part, str) for part in value):
        return "\n".join(value)
    return _text(value, "license") or ""


def _messages(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_MESSAGES:
        raise bad_request(f"messages must be a list of at most {MAX_MESSAGES} messages", "messages")
    for index, message in enumerate(value):
        if not (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
                and isinstance(message.get("content"), str)):  # fmt: skip
            raise bad_request(
                f"messages[{index}]: a role (system, user or assistant) and content", f"messages[{index}]"
            )
    return [{"role": message["role"], "content": message["content"]} for message in value]


_INSTRUCTION = re.compile(r"^([A-Za-z]+)\s+(.*?)\s*$", re.S)


def _from_modelfile(text: Any) -> dict[str, Any]:
    """An older client's ``modelfile``: its instructions (triple-quoted values over several lines), as ``Alias``'
    fields."""
    if not isinstance(text, str):
        raise bad_request("modelfile must be a string", "modelfile")
    made: dict[str, Any] = {"parameters": {}, "messages": []}
    for instruction, value in _instructions(text):
        if instruction in _REFUSED_LINES:
            raise bad_request(_REFUSED_LINES[instruction], "modelfile")
        if instruction in ("FROM", "SYSTEM", "LICENSE"):
            made[{"FROM": "target", "SYSTEM": "system", "LICENSE": "license"}[instruction]] = value
        elif instruction == "PARAMETER":
            key, _, raw = value.partition(" ")
            _add_parameter(made["parameters"], key, raw.strip())
        elif instruction == "MESSAGE":
            role, _, content = value.partition(" ")
            made["messages"] += _messages([{"role": role, "content": _unquoted(content.strip())}])
        else:
            raise bad_request(f"modelfile: {instruction} is not a Modelfile instruction", "modelfile")
    return made


def _instructions(text: str) -> list[tuple[str, str]]:
    """Each instruction and its value, comments and blank lines skipped, ``\"\"\"`` blocks joined."""
    found, lines = [], iter(text.splitlines())
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _INSTRUCTION.match(line.strip())
        if match is None:
            raise bad_request(f"modelfile: cannot read {line.strip()[:40]!r}", "modelfile")
        instruction, value = match.group(1).upper(), match.group(2)
        if value.startswith('"""'):
            value = value[3:]
            while not value.endswith('"""'):
                value += "\n" + next(lines, '"""')
            value = value[:-3]
        found.append((instruction, _unquoted(value) if instruction != "PARAMETER" else value))
    return found


def _unquoted(value: str) -> str:
    if len(value) >= 2 and value[0] == value[-1] == '"':
        try:
            return json.loads(value)
        except ValueError:
            return shlex.split(value)[0] if value.count('"') == 2 else value[1:-1]
    return value


def _add_parameter(parameters: dict[str, Any], key: str, raw: str) -> None:
    """``PARAMETER key value``: a number or a boolean as such, else text; ``stop`` may come several times."""
    try:
        value: Any = json.loads(raw)
    except ValueError:
        value = _unquoted(raw)
    if key == "stop":
        parameters.setdefault("stop", []).append(str(value))
    else:
        parameters[key] = value
