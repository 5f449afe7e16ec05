"""Each model family's tool-call syntax, and which one a model speaks: read from its chat template and its
vocabulary's added tokens. Torch-free.

=========  ====================================================  ==========================================
family     a call as the model writes it                         models
=========  ====================================================  ==========================================
hermes     ``<tool_call>\\n{"name": ..., "arguments": {..}}\\n``   Qwen 2.5/3, Hermes 2/3, SmolLM3; and any
           ``</tool_call>``, one block per call                  template without tools (the default tool
                                                                 prompt teaches it: SmolLM2)
llama3     ``{"name": ..., "parameters": {...}}`` as the whole   Llama 3.1, 3.2, 3.3 (one call a turn; its
           reply (``<|python_tag|>`` before it optional)        template refuses several)
mistral    ``[TOOL_CALLS][{"name": ..., "arguments": {...}},``   Mistral 7B v0.3, Nemo, Small (before 3.2)
           `` ...]``                                             (call ids of 9 letters and digits)
qwen-xml   ``<tool_call>\n<function=NAME>\n<parameter=P>\n``    Qwen3-Coder, Qwen3.5 (``xml_parser.py``:
           ``VALUE\n</parameter>\n</function>\n</tool_call>``    values typed by the tool's schema)
pythonic   ``<|tool_call_start|>[NAME(key=value, ...), ...]``   LFM2, LFM2.5 (``pythonic_parser.py``: Python
           ``<|tool_call_end|>``                                 literals or JSON values)
gemma      ``<|tool_call>call:NAME{key:<|"|>text<|"|>,n:1}``    Gemma 4 (``gemma_parser.py``: strings between
           ``<tool_call|>``, one block per call                  quote marks, keys bare)
=========  ====================================================  ==========================================

Markers that are tokens of the vocabulary are read and forced as tokens (``open_id``, ``close_id``): the
generated text keeps their spelling (``GenerationRequest.kept_special``) so the parser sees them where the
model wrote them, and the grammar names them by id. A template that renders tools in a syntax not in this table
(Command R, Granite 3, Functionary, GLM's ``<arg_key>``, Mistral's ``[ARGS]`` format, ...) has ``UNSUPPORTED``:
``tools`` is a 400.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class ToolSyntax:
    family: str
    #: What begins a call (hermes), or the calls (mistral; llama3's optional ``<|python_tag|>``).
    open: str
    #: What ends a call (hermes); "" where the calls run to the end of the reply.
    close: str = ""
    #: The key the call's arguments go under.
    arguments_key: str = "arguments"
    #: Between two calls: hermes writes each in its own block; mistral's are items of one JSON array.
    separator: str = "\n"
    #: Whether the chat template renders the tools and the tool traffic itself; else the default prompt does.
    native: bool = True
    #: The tokens that spell ``open`` and ``close``, where the vocabulary has them as single tokens.
    open_id: int | None = None
    close_id: int | None = None
    #: Whether several calls may come in one reply (Llama 3.1's template refuses to render more than one).
    parallel: bool = True
    #: Call ids as the template requires them (mistral: 9 letters and digits); 0: any.
    id_length: int = 0
    #: What marks a string's ends (Gemma 4's ``<|"|>``), and its token where the vocabulary has it.
    quote: str = ""
    quote_id: int | None = None

    @property
    def kept_special(self) -> frozenset[int]:
        """The marker tokens whose spelling the generated text keeps."""
        return frozenset(t for t in (self.open_id, self.close_id, self.quote_id) if t is not None)

    @property
    def array(self) -> bool:
        """The calls are one JSON array after ``open`` (mistral)."""
        return self.family == "mistral"

    @property
    def at_start(self) -> bool:
        """A call may also begin the reply without ``open``, its JSON object as the reply (llama3's own form;
        Qwen2.5-Coder writes its calls so, without ``<tool_call>``, when the choice is the model's)."""
        return self.family in ("llama3", "hermes")


OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES = ToolSyntax("hermes", OPEN, CLOSE)
LLAMA3 = ToolSyntax("llama3", "<|python_tag|>", arguments_key="parameters", separator="; ", parallel=False)
MISTRAL = ToolSyntax("mistral", "[TOOL_CALLS]", separator=", ", id_length=9)
QWEN_XML = ToolSyntax("qwen-xml", OPEN, CLOSE)
PYTHONIC = ToolSyntax("pythonic", "<|tool_call_start|>", "<|tool_call_end|>", separator=", ")
GEMMA = ToolSyntax("gemma", "<|tool_call>", "<tool_call|>", separator="", quote='<|"|>')
#: A template without tools: the default prompt (``app/pipeline/tools/prompt.py``) teaches the Hermes syntax, as text.
DEFAULT = ToolSyntax("hermes", OPEN, CLOSE, native=False)
#: A template that renders tools in a syntax this server cannot read back.
UNSUPPORTED = ToolSyntax("unsupported", "", native=False, parallel=False)

#: What in a template shows its syntax, most specific first: Gemma 4's calls, LFM2's tool list (its calls are not in
#: the template), XML-style arguments (Qwen3-Coder's and Qwen3.5's ``<parameter=``, GLM's ``<arg_key>``) and
#: Mistral's ``[ARGS]`` format come before the markers they share.
_SIGNS = (
    ("<|tool_call>call:", GEMMA), ("<|tool_list_start|>", PYTHONIC), ("List of tools: [", PYTHONIC),
    ("<parameter=", QWEN_XML), ("<function=", UNSUPPORTED), ("<arg_key>", UNSUPPORTED), ("[ARGS]", UNSUPPORTED),
    ("[TOOL_CALLS]", MISTRAL), ("<tool_call>", HERMES), ("<|python_tag|>", LLAMA3), ("<|start_header_id|>", LLAMA3),
)  # fmt: skip
#: A Hermes template writes a call as JSON with a name (GLM's and Laguna's ``<tool_call>name...`` do not).
_JSON_NAME = ('{"name"', '{\\"name\\"')


def detect(template: str | None, added: dict[str, int]) -> ToolSyntax:
    """The syntax a chat template speaks; ``added``: the vocabulary's added tokens by spelling."""
    template = template or ""
    signed = [syntax for sign, syntax in _SIGNS if sign in template]
    # Without a sign: a template that renders tools in a syntax not in the table, or one without tools.
    syntax = signed[0] if signed else UNSUPPORTED if "tools" in template else DEFAULT
    if syntax is QWEN_XML and "<function=" not in template:
        syntax = UNSUPPORTED
    if syntax is HERMES and not any(sign in template for sign in _JSON_NAME):
        syntax = UNSUPPORTED
    if syntax is LLAMA3 and '"parameters": ' not in template:  # a Llama 3 template without tools
        syntax = UNSUPPORTED if "tools" in template else DEFAULT
    if syntax in (UNSUPPORTED, DEFAULT):
        return syntax
    close_id = added.get(syntax.close) if syntax.close else None
    quote_id = added.get(syntax.quote) if syntax.quote else None
    return dataclasses.replace(syntax, open_id=added.get(syntax.open), close_id=close_id, quote_id=quote_id)
