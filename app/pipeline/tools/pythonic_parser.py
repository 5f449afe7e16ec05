"""Calls in LFM2's Python-like syntax read back out of a reply, and written into a conversation::

    <|tool_call_start|>[get_weather(city="Paris", unit="C"), get_time(zone="CET")]<|tool_call_end|>

A block holds a list of calls, each a function's name and keyword arguments whose values are Python literals (or
JSON's ``true``, ``false`` and ``null``, which LFM2 also writes, as llama.cpp's parser of the family reads them).
A block is read when it closes: each call's arguments come as one JSON object, whole (a value's text is no JSON
until it ends). A block that does not parse as calls is content; one cut by ``max_tokens`` is no call. Torch-free.
"""

from __future__ import annotations

import ast
import io
import json
import keyword
import tokenize
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from app.pipeline.tools.parser import BlockReading, ParsedCall

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
#: JSON's literals as LFM2 writes them, beside Python's own.
_NAMED = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


@dataclass(slots=True)
class PythonicCallParser(BlockReading):
    """``ToolCallParser``'s interface for LFM2's syntax: ``feed`` returns the content it can release and the
    ``tool_calls`` deltas (each call whole: its id, name and arguments). Fed the same text in any split, it
    releases the same content and calls."""

    OPEN: ClassVar[str] = OPEN
    CLOSE: ClassVar[str] = CLOSE
    calls: list[ParsedCall] = field(default_factory=list)
    content: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: Literal["text", "block"] = "text"
    _said: bool = False

    def _block_calls(self, block: str) -> list[tuple[str, dict[str, Any]]]:
        return parse_calls(block)


def parse_calls(block: str) -> list[tuple[str, dict[str, Any]]]:
    """A block's calls, ``[name(key=value, ...), ...]`` (or one call without the brackets): each name and its
    arguments; a ValueError where it is not that."""
    try:
        tree = ast.parse(_unkeyworded(block.strip()), mode="eval").body
        nodes = tree.elts if isinstance(tree, (ast.List, ast.Tuple)) else [tree]
        calls = []
        for node in nodes:
            if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
                raise ValueError("a call takes keyword arguments only")
            arguments = {_keyword(str(k.arg)): _literal(k.value) for k in node.keywords}
            calls.append((_keyword(_name(node.func)), arguments))
    except (SyntaxError, RecursionError, MemoryError, tokenize.TokenError) as exc:  # (nesting past the stack too)
        raise ValueError(f"not calls: {type(exc).__name__}") from None
    return calls


#: What a name that is a Python keyword (a tool ``import``, a parameter ``from``) is parsed as, and read back.
_KEYWORD = "_smolserve_keyword_"


def _unkeyworded(block: str) -> str:
    """``block`` with each keyword that names a function or a parameter (before ``(`` or ``=``) renamed
    (``_KEYWORD``), so that Python's parser reads it; strings untouched."""
    tokens = [t for t in tokenize.generate_tokens(io.StringIO(block).readline) if t.type != tokenize.NL]
    renamed = []
    for at, token in enumerate(tokens):
        following = tokens[at + 1].string if at + 1 < len(tokens) else ""
        named = token.type == tokenize.NAME and keyword.iskeyword(token.string) and following in ("(", "=")
        renamed.append((token.type, _KEYWORD + token.string if named else token.string))
    return tokenize.untokenize(renamed)


def _keyword(name: str) -> str:
    return name.removeprefix(_KEYWORD)


def _name(node: ast.expr) -> str:
    """A function's name: a name, or dotted names (``functions.get_weather``)."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value)}.{node.attr}"
    raise ValueError("a call's function is not a name")


def _literal(node: ast.expr) -> Any:
    """A value: a Python literal, or JSON's ``true``, ``false``, ``null``; nothing that runs."""
    if isinstance(node, ast.Constant) and not isinstance(node.value, (bytes, complex, type(...))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED:
        return _NAMED[node.id]
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        return {str(_literal(key)): _literal(value) for key, value in zip(node.keys, node.values, strict=True)}  # type: ignore[arg-type]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("an argument's value is not a literal")


def call_text(calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as LFM2 writes them: one block, each value as JSON (which LFM2 reads: ``true``, ``null``, ...)."""
    written = [f"{name}({', '.join(f'{key}={json.dumps(value, ensure_ascii=False)}' for key, value in args.items())})"
               for name, args in calls]  # fmt: skip
    return f"{OPEN}[{', '.join(written)}]{CLOSE}"
