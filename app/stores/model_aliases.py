"""Models made by Ollama's ``/api/create`` and ``/api/copy``: each an alias of a served model with its own default
options, system prompt and opening messages (what a Modelfile's ``FROM``, ``PARAMETER``, ``SYSTEM`` and ``MESSAGE``
say), kept in ``--data-dir``/``ollama-models.json`` so that they outlive a restart, as Ollama's do. The weights are
never copied: an alias names the file's model it was made from. Torch-free."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

FILE = "ollama-models.json"
#: The most models made by ``/api/create`` and ``/api/copy`` one server keeps, and the most bytes each may take
#: (its system prompt, messages, license and options as JSON): 16 MiB in all at most.
MAX_ALIASES = 256
MAX_ALIAS_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Alias:
    name: str
    #: The served model it answers with (a name of a file's model, never another alias).
    target: str
    #: Ollama's options its requests start from (a request's own ``options`` win).
    parameters: dict[str, Any] = field(default_factory=dict)
    #: Its system prompt, where a request gives none.
    system: str | None = None
    #: Messages before every conversation (a Modelfile's ``MESSAGE`` lines).
    messages: list[dict[str, Any]] = field(default_factory=list)
    license: str = ""
    created: float = field(default_factory=time.time)

    def modelfile(self) -> str:
        """The Modelfile that makes it, as ``/api/show`` gives one."""
        lines = [f"FROM {self.target}"]
        if self.system:
            lines.append(f"SYSTEM {json.dumps(self.system)}")
        for key, value in self.parameters.items():
            for one in value if isinstance(value, list) else [value]:
                lines.append(f"PARAMETER {key} {json.dumps(one) if isinstance(one, str) else one}")
        lines += [f"MESSAGE {m.get('role')} {json.dumps(m.get('content', ''))}" for m in self.messages]
        return "\n".join(lines) + "\n"

    def parameter_text(self) -> str:
        """``/api/show``'s ``parameters``: one ``name value`` a line."""
        return "\n".join(line.removeprefix("PARAMETER ") for line in self.modelfile().splitlines()
                         if line.startswith("PARAMETER "))  # fmt: skip


class AliasFull(Exception):
    """No room for one more alias (``MAX_ALIASES``)."""


class AliasStore:
    """The aliases, in memory and in their file (written whole to a temporary name, then renamed)."""

    def __init__(self, directory: Path | None) -> None:
        self.path = None if directory is None else directory / FILE
        self._lock = threading.Lock()
        self._aliases: dict[str, Alias] = self._read()

    def get(self, name: str) -> Alias | None:
        return self._aliases.get(name)

    def all(self) -> list[Alias]:
        return sorted(self._aliases.values(), key=lambda alias: alias.name)

    def put(self, alias: Alias) -> None:
        """Keep ``alias`` (replacing one of its name); ``AliasFull`` past ``MAX_ALIASES``, ``ValueError`` past
        ``MAX_ALIAS_BYTES``."""
        if len(json.dumps(asdict(alias))) > MAX_ALIAS_BYTES:
            raise ValueError(f"a made model's system prompt, messages, license and options: at most {MAX_ALIAS_BYTES} "
                             "bytes together")  # fmt: skip
        with self._lock:
            if alias.name not in self._aliases and len(self._aliases) >= MAX_ALIASES:
                raise AliasFull(f"this server keeps at most {MAX_ALIASES} models made by /api/create or /api/copy")
            self._aliases[alias.name] = alias
            self._write()

    def delete(self, name: str) -> bool:
        with self._lock:
            if self._aliases.pop(name, None) is None:
                return False
            self._write()
            return True

    def _read(self) -> dict[str, Alias]:
        if self.path is None or not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text())
            return {entry["name"]: Alias(**entry) for entry in entries}
        except (OSError, ValueError, TypeError, KeyError):
            return {}  # a file this server cannot read is not used (and is replaced by the next write)

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps([asdict(alias) for alias in self._aliases.values()], indent=1))
        os.replace(temporary, self.path)
