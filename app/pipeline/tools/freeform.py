"""Custom (freeform) tools' grammars, held inside a call's JSON: a tool whose input is free text in a Lark grammar
or a regex (the Responses API's ``custom`` tools: Codex's ``apply_patch``) is offered to the model as a function
of one string, ``input``; the call's JSON string must then decode to a text of the tool's grammar.

JSON escapes a character as a fixed string (``"`` as ``\\"``, a newline as ``\\n``), so the escaped texts of a
regular or context-free language are one too: each string literal of the grammar is escaped, and each regex is
rewritten over Python's own parse of it into grammar rules, a character class becoming its plain characters (a
class intersection) or the escapes of those it holds. An escape is a lexeme of its own: inside a longer lexeme its
backslash would leave llguidance's lexer (which does not backtrack) unsure where the lexeme ends, so the grammar's
terminals become rules too. llguidance then holds the call to it token by token.
Torch-free.
"""

from __future__ import annotations

import ast
import json
import re
from re import _constants as sre  # type: ignore[attr-defined]
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any

from app.wire.openai.errors import bad_request
from app.wire.openai.messages import FunctionDefinition, Tool

#: A custom tool's grammar, in characters (Codex's ``apply_patch`` grammar: 790): its rewriting runs on the event
#: loop.
MAX_GRAMMAR_CHARS = 65_536
#: What a custom tool is offered to the model as: a function of one string.
_INPUT_SCHEMA = {"type": "object", "properties": {"input": {"type": "string", "description": "The tool's input."}},
                 "required": ["input"], "additionalProperties": False}  # fmt: skip


def offer_custom(
    name: str, description: str | None, syntax: str | None, definition: str | None, param: str
) -> tuple[Tool, str]:
    """A custom tool (free text when ``syntax`` is None, else a ``lark`` or ``regex`` grammar ``definition``) as the
    function the model is offered, and the Lark grammar its ``input`` string holds to, JSON-escaped ("" for free
    text). ``param``: the definition's path in the request, for errors."""
    grammar, note = "", ""
    if syntax is not None and definition is not None:
        if len(definition) > MAX_GRAMMAR_CHARS:
            raise bad_request(f"{param}: a grammar of at most {MAX_GRAMMAR_CHARS} characters, got {len(definition)}",
                              param)  # fmt: skip
        grammar = escaped_lark(definition, param) if syntax == "lark" else f"start: {escaped_regex(definition, param)}"
        note = f"\n\nThe input follows this {syntax} grammar:\n{definition}"
    described = (description or "") + note
    function = FunctionDefinition(name=name, description=described or None, parameters=_INPUT_SCHEMA)
    return Tool(type="function", function=function), grammar


def custom_input(arguments: str) -> str:
    """The input of a custom tool's call, from its arguments (``custom_arguments``); of a call cut short by
    the token budget, as much of its input as was written."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return _partial_input(arguments)
    return value["input"] if isinstance(value, dict) and isinstance(value.get("input"), str) else arguments


def _partial_input(arguments: str) -> str:
    head = '{"input": "'
    if not arguments.startswith(head):
        return ""
    written = arguments[len(head) :]
    for cut in range(min(len(written), 6) + 1):  # an escape cut in two (at most ``\\uXXX``) is left out
        try:
            return json.loads('"' + written[: len(written) - cut] + '"')
        except ValueError:
            continue
    return ""


#: The characters a JSON string escapes: a quote, a backslash and the control characters.
_ESCAPED = ['"', "\\", *map(chr, range(0x20))]
#: A class of every character JSON writes as itself (Rust's regex syntax, llguidance's).
_PLAIN = r'[^"\\\x00-\x1f]'
#: The terminals of Lark's ``common`` module a grammar may import, as Lark defines them (ASCII classes).
_COMMON = {
    "DIGIT": r"/[0-9]/", "HEXDIGIT": r"/[a-fA-F0-9]/", "INT": r"/[0-9]+/", "SIGNED_INT": r"/[+-]?[0-9]+/",
    "DECIMAL": r"/[0-9]+\.[0-9]*|\.[0-9]+/",
    "NUMBER": r"/[0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?/",
    "SIGNED_NUMBER": r"/[+-]?([0-9]+(\.[0-9]*)?([eE][+-]?[0-9]+)?|\.[0-9]+([eE][+-]?[0-9]+)?)/",
    "LCASE_LETTER": r"/[a-z]/", "UCASE_LETTER": r"/[A-Z]/", "LETTER": r"/[a-zA-Z]/", "WORD": r"/[a-zA-Z]+/",
    "CNAME": r"/[_a-zA-Z][_a-zA-Z0-9]*/", "WS_INLINE": r"/[ \t]+/", "WS": r"/[ \t\f\r\n]+/", "CR": r"/\r/",
    "LF": r"/\n/", "NEWLINE": r"/(\r?\n)+/", "ESCAPED_STRING": r'/"([^"\\]|\\.)*"/',
}  # fmt: skip
#: A Lark grammar's pieces: comments, strings (a range of two), regexes, imports, and what is left as it is.
_LARK = re.compile(
    r"""(?P<comment>//[^\n]*|\#[^\n]*)"""
    r"""|(?P<range>"(?:[^"\\\n]|\\.)*"\s*\.\.\s*"(?:[^"\\\n]|\\.)*")"""
    r"""|(?P<string>"(?:[^"\\\n]|\\.)*"i?)"""
    r"""|(?P<regex>/(?:[^/\\\n]|\\.)+/[imslux]*)"""
    r"""|(?P<import>%import[ \t]+common(?:\.\w+(?:[ \t]*->[ \t]*\w+)?|[ \t]*\([\w, \t]*\)))"""
    r"""|(?P<refused>%json|<\[|<\|)"""
    r"""|(?P<other>[^"/#%<]+|[#%<])""",
    re.DOTALL,
)


def escaped_lark(grammar: str, param: str) -> str:
    """The Lark grammar of the JSON-escaped texts of ``grammar``'s language; a 400 naming ``param`` for what
    cannot be rewritten (``%json``, special tokens, case-insensitive strings, unknown imports)."""
    out, position = [], 0
    while position < len(grammar):
        match = _LARK.match(grammar, position)
        if match is None:  # a lone quote or slash: Lark's own error is clearer than ours
            raise bad_request(f"{param}: the grammar cannot be read at {grammar[position : position + 20]!r}", param)
        kind, text = match.lastgroup, match.group()
        position = match.end()
        out.append(_piece(kind, text, param))
    return "".join(out)


def _piece(kind: str | None, text: str, param: str) -> str:
    if kind == "comment":
        return ""
    if kind == "string":
        if text.endswith("i"):
            raise bad_request(f"{param}: case-insensitive strings are not supported in a custom tool's grammar", param)
        return json.dumps(_escape(ast.literal_eval(text)), ensure_ascii=False)
    if kind == "range":
        low, high = (ast.literal_eval(end.strip()) for end in text.split(".."))
        return escaped_regex(f"[{re.escape(low)}-{re.escape(high)}]", param)
    if kind == "regex":
        body, flags = text[1:].rsplit("/", 1)
        if set(flags) - {"s"}:
            raise bad_request(f"{param}: regex flags other than s are not supported in a custom tool's grammar", param)
        pattern = ("(?s)" if flags else "") + body.replace("\\/", "/")
        return escaped_regex(pattern, param)
    if kind == "import":
        return _imports(text, param)
    if kind == "refused":
        raise bad_request(f"{param}: {text}... cannot be part of a custom tool's grammar", param)
    return _TERMINAL.sub(_as_rule, text)


#: A terminal's name (with its priority where it is defined): each becomes a rule, ``t_`` and its name in lower case.
_TERMINAL = re.compile(r"(?<![\w.])(_?[A-Z][A-Z0-9_]*)(\.-?\d+)?(?![\w])")


def _as_rule(match: re.Match[str]) -> str:
    return "t_" + match.group(1).lower()


def _imports(statement: str, param: str) -> str:
    """``%import common.X [-> Y]`` or ``%import common (X, Y)``: the terminals defined here, escaped."""
    if "(" in statement:
        names = [(name.strip(), name.strip()) for name in statement.split("(")[1].rstrip(")").split(",")]
    else:
        name, _, alias = statement.split(".", 1)[1].partition("->")
        names = [(name.strip(), (alias or name).strip())]
    lines = []
    for name, alias in names:
        if name not in _COMMON:
            raise bad_request(f"{param}: common.{name} cannot be imported into a custom tool's grammar", param)
        lines.append(f"{_as_rule_name(alias)}: {_piece('regex', _COMMON[name], param)}")
    return "\n".join(lines)


def _as_rule_name(name: str) -> str:
    return _TERMINAL.sub(_as_rule, name)


def _escape(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _string(text: str) -> str:
    """A Lark string of ``text`` escaped."""
    return json.dumps(_escape(text), ensure_ascii=False)


def escaped_regex(pattern: str, param: str) -> str:
    """A Lark expression (rules' syntax) of the JSON-escaped texts that ``pattern`` matches."""
    try:
        parsed = sre_parse.parse(pattern)
    except re.error as exc:
        raise bad_request(f"{param}: not a regex: {exc}", param) from None
    return _Rewriter(param, bool(parsed.state.flags & re.DOTALL)).sequence(list(parsed))


class _Rewriter:
    def __init__(self, param: str, dotall: bool) -> None:
        self.param, self.dotall = param, dotall

    def sequence(self, items: list[tuple[Any, Any]]) -> str:
        return "(" + (" ".join(self.item(op, value) for op, value in items) or '""') + ")"

    def item(self, op: Any, value: Any) -> str:
        if op is sre.LITERAL:
            return _string(chr(value))
        if op in (sre.NOT_LITERAL, sre.ANY, sre.IN, sre.CATEGORY):
            return self.char_class(_class_text(op, value, self.dotall))
        if op is sre.SUBPATTERN:
            _group, add, remove, inner = value
            if add & ~re.DOTALL or remove:
                raise bad_request(f"{self.param}: only the s flag is supported in a custom tool's regex", self.param)
            outer, self.dotall = self.dotall, self.dotall or bool(add & re.DOTALL)
            try:
                return self.sequence(list(inner))
            finally:
                self.dotall = outer
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):
            low, high, inner = value
            bound = f"{{{low},}}" if high is sre.MAXREPEAT else f"{{{low},{high}}}"
            return f"{self.sequence(list(inner))}{bound}"
        if op is sre.BRANCH:
            return "(" + " | ".join(self.sequence(list(branch)) for branch in value[1]) + ")"
        if op is sre.AT:  # anchors: a terminal is matched whole
            return '""'

        raise bad_request(f"{self.param}: {str(op).lower()} is not supported in a custom tool's regex", self.param)

    def char_class(self, text: str) -> str:
        """The class's plain characters, or the escape of each JSON-escaped character it holds."""
        held = re.compile(text)
        escapes = [_string(char) for char in _ESCAPED if held.fullmatch(char)]
        plain = f"/[{text}&&{_PLAIN}]/"  # no slash: ``_class_char`` spells it as an escape
        return "(" + " | ".join([plain, *escapes]) + ")"


def _class_text(op: Any, value: Any, dotall: bool) -> str:
    """A one-character item as a class (Python's and Rust's syntax alike): ``[...]``."""
    if op is sre.ANY:
        return "[\\s\\S]" if dotall else "[^\\n]"
    if op is sre.NOT_LITERAL:
        return f"[^{_class_char(value)}]"
    items = [(op, value)] if op is sre.CATEGORY else value
    negated = bool(items) and items[0][0] is sre.NEGATE
    parts = []
    for kind, item in items[1:] if negated else items:
        if kind is sre.LITERAL:
            parts.append(_class_char(item))
        elif kind is sre.RANGE:
            parts.append(f"{_class_char(item[0])}-{_class_char(item[1])}")
        elif kind is sre.CATEGORY:
            parts.append(_CATEGORIES[item])
        else:
            raise ValueError(f"unexpected class item {kind}")
    return "[" + ("^" if negated else "") + "".join(parts) + "]"


def _class_char(code: int) -> str:
    return chr(code) if chr(code).isalnum() else f"\\U{code:08x}"  # Python's and Rust's spelling alike


_CATEGORIES = {
    sre.CATEGORY_DIGIT: "\\d", sre.CATEGORY_NOT_DIGIT: "\\D", sre.CATEGORY_SPACE: "\\s",
    sre.CATEGORY_NOT_SPACE: "\\S", sre.CATEGORY_WORD: "\\w", sre.CATEGORY_NOT_WORD: "\\W",
}  # fmt: skip
