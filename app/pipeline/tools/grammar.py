"""The grammar that holds a reply's calls to the offered tools' schemas, in the model's family's syntax
(llguidance's Lark dialect). A marker the vocabulary has as a token is forced as that token (``<[id]>``), never
spelled out in text the model was not trained to write."""

from __future__ import annotations

import json
from typing import Any

from app.pipeline.tools import ToolCalling
from app.pipeline.tools.syntax import DEFAULT, GEMMA, PYTHONIC, QWEN_XML, ToolSyntax
from app.pipeline.tools.xml_parser import FUNCTION, FUNCTION_END, PARAMETER, PARAMETER_END
from app.wire.openai.messages import Tool
from engine.core.grammar import JSON_STYLE


def call_schema(tool: Tool, arguments_key: str = "arguments") -> dict[str, Any]:
    """A JSON schema for one call of ``tool``: ``{"name": <its name>, <arguments_key>: <its parameters>}``, in
    that order. The parameters' ``$defs`` move to the root, where their ``#/$defs/...`` references point."""
    parameters = dict(tool.function.parameters)
    hoisted = {key: parameters.pop(key) for key in ("$defs", "definitions") if key in parameters}
    parameters.setdefault("type", "object")  # the API's arguments are an object
    return {
        "type": "object",
        "properties": {"name": {"const": tool.function.name}, arguments_key: parameters},
        "required": ["name", arguments_key],
        "additionalProperties": False,
        # As the tool prompt and call_text write calls; keywords llguidance does not implement (propertyNames, in
        # Claude Code's tools) are not enforced, not a 400: the arguments still follow the rest of the schema.
        "x-guidance": {**JSON_STYLE, "lenient": True},
        **hoisted,
    }


def no_calls(syntax: ToolSyntax) -> str:
    """``tool_choice: "none"``: any text without the call marker's spelling. The tools stay in the prompt, as
    OpenAI and vLLM show them, but no call can start (a marker token is no text: the text rule cannot make it)."""
    return f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*{_escaped(syntax.open)}.*)/\n"


def tool_grammar(calling: ToolCalling, syntax: ToolSyntax = DEFAULT) -> str:
    """The Lark grammar (llguidance's dialect) the reply must follow."""
    if not calling.calls_allowed:
        return "%llguidance {}\n" + no_calls(syntax)
    bodies_of = {QWEN_XML.family: _xml_body, PYTHONIC.family: _pythonic_body, GEMMA.family: _gemma_body}
    body = bodies_of.get(syntax.family, _body)
    bodies = [body(i, tool, calling, syntax) for i, tool in enumerate(calling.offered())]
    parallel = calling.parallel and syntax.parallel and calling.choice in ("auto", "required")
    rules = [*_calls(syntax, parallel), *_start(calling.choice == "auto", syntax)]
    rules += ["body: " + " | ".join(f"fn_{i}" for i in range(len(bodies))), *bodies]
    if syntax.family == GEMMA.family:
        rules += _gemma_values(syntax)
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _body(index: int, tool: Tool, calling: ToolCalling, syntax: ToolSyntax) -> str:
    """Rule ``fn_<index>``: a call of ``tool``, as JSON of its schema; a custom tool's ``input`` string held to its
    grammar (written as ``call_schema`` writes the call)."""
    name = tool.function.name
    if name not in calling.freeform:
        return f"fn_{index}: %json {json.dumps(call_schema(tool, syntax.arguments_key))}"
    head = json.dumps(f'{{"name": {json.dumps(name)}, "{syntax.arguments_key}": {{"input": "')
    return f'fn_{index}: {head} input_{index} "\\"}}}}"\ninput_{index}: %lark {{\n{calling.freeform[name]}\n}}'


def _xml_body(index: int, tool: Tool, calling: ToolCalling, syntax: ToolSyntax) -> str:
    """Rule ``fn_<index>``: a call of ``tool`` in the XML syntax (``xml_parser.py``): its parameters in the schema's
    order, the required ones always; a string's value text up to its closing tag (within its ``minLength`` and
    ``maxLength``; a string ``enum``: one of its values), any other value JSON of its schema; a custom tool's
    ``input`` held to its grammar."""
    name = tool.function.name
    head = json.dumps(f"{FUNCTION}{name}>\n")
    if name in calling.freeform:
        opening = json.dumps(PARAMETER + "input>\n")
        body = f"fn_{index}: {head} {opening} input_{index} {_PARAMETER_TAIL} {json.dumps(FUNCTION_END)}"
        return f"{body}\ninput_{index}: %lark {{\n{calling.freeform[name]}\n}}"
    parameters = tool.function.parameters
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    required = set(parameters.get("required") or ())
    parts, rules = [], []
    for j, (key, schema) in enumerate((parameters.get("properties") or {}).items()):
        rule = f"p_{index}_{j}"
        opening = json.dumps(f"{PARAMETER}{key}>\n")
        value = _xml_value(schema, defs)
        if value.startswith("/"):  # a string's text and its closing tag: one lexeme, ended at the first tag
            rules.append(f"{rule}: {opening} text_{index}_{j}\ntext_{index}_{j}[lazy]: {value} {_PARAMETER_TAIL}")
        else:
            rules.append(f"{rule}: {opening} {value} {_PARAMETER_TAIL}")
        parts.append(rule if key in required else f"{rule}?")
    rules.insert(0, f"fn_{index}: {head} {' '.join(parts)} {json.dumps(FUNCTION_END)}")
    return "\n".join(rules)


#: What ends a parameter's value in the XML syntax.
_PARAMETER_TAIL = json.dumps(f"\n{PARAMETER_END}\n")


def _xml_value(schema: Any, defs: dict[str, Any]) -> str:
    """A parameter's value: a string's text as a regex (``/.../``, its length within the schema's bounds), one of a
    string ``enum``'s values, or JSON of its schema."""
    if not isinstance(schema, dict):
        return "/(?s:.*)/"
    values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if values and all(isinstance(value, str) for value in values):
        return "(" + " | ".join(json.dumps(value) for value in values) + ")"
    if schema.get("type") == "string":
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return f"/(?s:.{{{low},{'' if high is None else int(high)}}})/" if low or high is not None else "/(?s:.*)/"
    return f"%json {json.dumps({**schema, **defs, 'x-guidance': {**JSON_STYLE, 'lenient': True}})}"


def _pythonic_body(index: int, tool: Tool, calling: ToolCalling, syntax: ToolSyntax) -> str:
    """Rule ``fn_<index>``: a call of ``tool`` as LFM2 writes it (``pythonic_parser.py``): ``name(key=value, ...)``,
    the schema's parameters in its order, the required ones always, each value JSON of its schema (which LFM2
    reads, ``true`` and ``null`` too); a custom tool's ``input`` a JSON string held to its grammar."""
    name = tool.function.name
    if name in calling.freeform:
        head = json.dumps(f'{name}(input="')
        return f'fn_{index}: {head} input_{index} "")"\ninput_{index}: %lark {{\n{calling.freeform[name]}\n}}'
    parameters = tool.function.parameters
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    required = set(parameters.get("required") or ())
    keys = list((parameters.get("properties") or {}).items())
    rules = []
    for j, (key, schema) in enumerate(keys):
        value = {**schema, **defs, "x-guidance": {**JSON_STYLE, "lenient": True}} if isinstance(schema, dict) else {}
        rules.append(f"p_{index}_{j}: {json.dumps(key + '=')} %json {json.dumps(value)}")
    arguments = _keyword_list(index, [key not in required for key, _ in keys], '", "')
    rules.insert(0, f'fn_{index}: {json.dumps(name + "(")} {arguments} ")"')
    return "\n".join(rules)


def _gemma_body(index: int, tool: Tool, calling: ToolCalling, syntax: ToolSyntax) -> str:
    """Rule ``fn_<index>``: a call of ``tool`` as Gemma 4 writes it (``gemma_parser.py``): ``NAME{key:value,...}``,
    the schema's parameters in its order, the required ones always; a string's value its text between quote marks
    (a string ``enum``: one of its values), a number's or a boolean's JSON of its schema, any other value one of
    Gemma's (an array or object of them), as llama.cpp's grammar of the family holds them; a custom tool's
    ``input`` held to its grammar."""
    name, quote = tool.function.name, _marker(syntax.quote, syntax.quote_id)
    if name in calling.freeform:
        head = json.dumps(f"{name}{{input:")
        body = f'fn_{index}: {head} {quote} input_{index} {quote} "}}"'
        return f"{body}\ninput_{index}: %lark {{\n{calling.freeform[name]}\n}}"
    parameters = tool.function.parameters
    defs = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    required = set(parameters.get("required") or ())
    keys = list((parameters.get("properties") or {}).items())
    rules = [f"p_{index}_{j}: {json.dumps(key + ':')} {_gemma_value(schema, defs, quote, syntax)}"
             for j, (key, schema) in enumerate(keys)]  # fmt: skip
    arguments = _keyword_list(index, [key not in required for key, _ in keys], '","')
    rules.insert(0, f'fn_{index}: {json.dumps(name + "{")} {arguments} "}}"')
    return "\n".join(rules)


def _gemma_value(schema: Any, defs: dict[str, Any], quote: str, syntax: ToolSyntax) -> str:
    """A parameter's value in Gemma's notation: a string's text between quote marks (within its ``minLength`` and
    ``maxLength`` where the mark is a token; one of a string ``enum``'s values), a number's or boolean's JSON of
    its schema, else any of Gemma's values."""
    if not isinstance(schema, dict):
        return "g_value"
    values = schema.get("enum") or ([schema["const"]] if "const" in schema else None)
    if values and all(isinstance(value, str) for value in values):
        return f"{quote} (" + " | ".join(json.dumps(value) for value in values) + f") {quote}"
    if schema.get("type") == "string" and syntax.quote_id is not None:
        return f"{quote} {_xml_value(schema, defs)} {quote}"  # (a token ends the text: no text spells it)
    if schema.get("type") == "string":
        return "g_string"
    if schema.get("type") in ("number", "integer", "boolean"):
        return f"%json {json.dumps({**schema, **defs, 'x-guidance': {**JSON_STYLE, 'lenient': True}})}"
    return "g_value"


def _gemma_values(syntax: ToolSyntax) -> list[str]:
    """Gemma's values (``gemma_parser.py``), as llama.cpp's grammar of the family has them: a string between quote
    marks, an object of bare keys, an array, a number, ``true``, ``false``, ``null``."""
    quote = _marker(syntax.quote, syntax.quote_id)
    text = (
        "G_TEXT: /(?s:.*)/"
        if syntax.quote_id is not None
        else f"G_TEXT: /(?s:.*)/ & ~/(?s:.*{_escaped(syntax.quote)}.*)/"
    )
    return [
        'g_value: g_string | g_object | g_array | G_NUMBER | "true" | "false" | "null"',
        f"g_string: {quote} G_TEXT {quote}",
        text,
        'g_object: "{" (G_KEY ":" g_value ("," G_KEY ":" g_value)*)? "}"',
        'g_array: "[" (g_value ("," g_value)*)? "]"',
        "G_KEY: /[^:}{,\\[\\]]+/",
        "G_NUMBER: /-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?/",
    ]


def _keyword_list(index: int, optional: list[bool], separator: str) -> str:
    """Parameters ``p_<index>_<j>`` in their order, the required ones always, each after the one before behind
    ``separator``."""

    def rest(j: int) -> str:  # parameters j.. after one was written: each behind the separator
        if j == len(optional):
            return ""
        written = f"{separator} p_{index}_{j}"
        return f"{f'({written})?' if optional[j] else written} {rest(j + 1)}".strip()

    def first(j: int) -> str:  # parameters j.. with none written before, at least one
        own = f"p_{index}_{j} {rest(j + 1)}".strip()
        return f"({own} | {first(j + 1)})" if optional[j] and j + 1 < len(optional) else own

    return "" if not optional else f"({first(0)})?" if all(optional) else first(0)


def _calls(syntax: ToolSyntax, parallel: bool) -> list[str]:
    """``calls``: what follows the first marker, one call or several; ``bare``: calls that begin the reply without
    it (``ToolSyntax.at_start``)."""
    more = f" ({json.dumps(syntax.separator)} body)*" if parallel else ""
    if syntax.family == GEMMA.family:  # Gemma 4: <|tool_call>call:NAME{...}<tool_call|>, block after block
        again = f" ({_marker(syntax.open, syntax.open_id)} call)*" if parallel else ""
        return [f"calls: call{again}", f'call: "call:" body {_marker(syntax.close, syntax.close_id)}']
    if syntax.family == PYTHONIC.family:  # LFM2: [call, call]<|tool_call_end|>
        return [f'calls: "[" body{more} "]" {_marker(syntax.close, syntax.close_id)}']
    if syntax.array:  # mistral: [TOOL_CALLS][{...}, {...}]
        return [f'calls: "[" body{more} "]"']
    if not syntax.close:  # llama3: the calls are the reply
        return [f"calls: body{more}"]
    # hermes: each call in its own block; a line may end the last (the model may then stop or open another).
    call = f'"\\n" body "\\n" {_marker(syntax.close, syntax.close_id)}'
    again = f' ("\\n" {_marker(syntax.open, syntax.open_id)} call)*' if parallel else ""
    # Without the marker, one call (a model that drops it does not write several alike).
    return [f'calls: call{again} "\\n"?', f"call: {call}", f'bare: (body | {_FENCED}) "\\n"?']


def _start(auto: bool, syntax: ToolSyntax) -> list[str]:
    """Calls only; or (``auto``) text, calls after text (hermes, mistral), or calls as the whole reply (llama3,
    and hermes without its marker). Text that begins as a call's object must be one."""
    opener = _marker(syntax.open, syntax.open_id)
    if syntax.at_start and not syntax.close:  # llama3: the reply is a call (the tag before it optional)
        if not auto:
            return ["start: calls"]
        return [f"start: TEXT | {opener}? calls | {_FENCED}", f"TEXT: /(?s:.*)/ & {_NOT_A_CALL}"]
    if not auto:
        return [f"start: {opener} calls"]
    bare, not_a_call = (" | bare", f" & {_NOT_A_CALL}") if syntax.at_start else ("", "")
    if syntax.open_id is not None:  # a token ends the text: the calls follow it
        return [f"start: TEXT | TEXT? {opener} calls{bare}", f"TEXT: /(?s:.+)/{not_a_call}"]
    # Text, or text up to the trigger and then calls: the lazy trigger ends at the first spelling of the marker.
    return [f"start: TEXT | trigger calls{bare}", f"trigger[lazy]: TEXT {opener}", f"TEXT: /(.|\\n)*/{not_a_call}"]


#: A bare call in a JSON code fence, as Qwen2.5-Coder often writes it.
_FENCED = '"```json\\n" body "\\n```"'
#: Text that does not begin as a call's object would, with ``{`` or a JSON code fence: the grammar's lexer takes
#: the longest lexeme, so text that could begin ``{"name"`` would shadow the call's first lexeme. A reply that
#: begins so is a call.
_NOT_A_CALL = "~/(?s:\\s*(\\{|```json).*)/"


def _marker(text: str, token: int | None) -> str:
    return f"<[{token}]>" if token is not None else json.dumps(text)


def _escaped(text: str) -> str:
    """``text`` as a regex inside Lark's ``/.../``."""
    return "".join(f"\\{char}" if char in r"\/.^$|?*+()[]{}" else char for char in text)
