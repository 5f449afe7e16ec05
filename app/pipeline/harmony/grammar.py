"""Grammars (llguidance's Lark) that hold a harmony reply to its shape where a request constrains it: calls
(``tool_choice`` required or named, or ``auto``: the answer or a call), no calls (``none``), a structured output
as the final answer, a reasoning budget. The reasoning (one ``analysis`` message, optional) stays free text
within its budget; the markers are forced as their tokens; a call's arguments are JSON of its function's
parameters and end with ``<|call|>``, as harmony writes a call."""

from __future__ import annotations

import json
from typing import Any

from app.pipeline.harmony.encoding import CALL, CHANNEL, CONSTRAIN, END, MESSAGE, START, Harmony
from app.pipeline.harmony.reader import FUNCTIONS
from app.pipeline.tools import ToolCalling
from app.wire.openai.sampling import StructuredOutput
from engine.core.grammar import JSON_STYLE


def reply_grammar(
    harmony: Harmony,
    calling: ToolCalling | None,
    structured: StructuredOutput | None,
    budget: int | None,
    inside: bool = False,
) -> str | None:
    """The reply's grammar; None where nothing constrains it (no tools, no structured output, no budget).
    ``inside``: the prompt already opened the final message (a prefill): the answer alone follows."""
    if calling is None and structured is None and budget is None:
        return None
    if inside:
        return f"%llguidance {{}}\nstart: {_answer(structured)}\n"
    mark = {marker: f"<[{token}]>" for marker, token in harmony.ids.items()}
    answers = []
    if calling is None or calling.choice in ("auto", "none"):
        answers.append("final")
    if calling is not None and calling.calls_allowed:
        answers += [f"fn_{index}" for index in range(len(calling.offered()))]
    limit = f"[max_tokens={budget}]" if budget is not None else ""
    rules = [
        f"start: analysis? ({' | '.join(answers)})",
        f'analysis: {mark[CHANNEL]} "analysis" {mark[MESSAGE]} thought {mark[END]} {mark[START]} "assistant"',
        f"thought{limit}: /(?s:.*)/",
        f'final: {mark[CHANNEL]} "final" {mark[MESSAGE]} answer',
        f"answer: {_answer(structured)}",
    ]
    for index, tool in enumerate(calling.offered() if calling is not None and calling.calls_allowed else []):
        head = json.dumps(f" to={FUNCTIONS}{tool.function.name}")
        opening = f'{mark[CHANNEL]} "commentary " {mark[CONSTRAIN]} "json" {mark[MESSAGE]}'
        arguments = json.dumps(_arguments(tool.function.parameters))
        rules.append(f"fn_{index}: {head} {opening} %json {arguments} {mark[CALL]}")
    return "%llguidance {}\n" + "\n".join(rules) + "\n"


def _answer(structured: StructuredOutput | None) -> str:
    """The final answer's rule: free text, or the structured output asked for."""
    if structured is None:
        return "/(?s:.*)/"
    value = structured.value
    match structured.kind:
        case "json":
            schema = value if isinstance(value, dict) else {} if value else {"not": {}}
            return f"%json {json.dumps({**schema, 'x-guidance': JSON_STYLE})}"
        case "regex":
            return "/" + value.replace("/", "\\/") + "/"
        case "choice":
            return " | ".join(json.dumps(option) for option in value)
        case _:
            return f"%lark {{\n{value}\n}}"


def _arguments(parameters: dict[str, Any]) -> dict[str, Any]:
    """A call's arguments: an object of the function's parameters, in the JSON style calls are written in."""
    return {"type": "object", **parameters, "x-guidance": {**JSON_STYLE, "lenient": True}}
