"""A reply read as its model's family writes it: the reasoning first (``app/pipeline/reasoning.py``), then the answer,
whose tool calls become calls (``app/pipeline/tools/parser.py``) and the rest content. Chat completions and the
Responses API shape the same pieces. Torch-free."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from app.pipeline.reasoning import THINK, ReasoningParser, Tags
from app.pipeline.tools.gemma_parser import GemmaCallParser
from app.pipeline.tools.parser import ParsedCall, ToolCallParser
from app.pipeline.tools.pythonic_parser import PythonicCallParser
from app.pipeline.tools.syntax import GEMMA, PYTHONIC, QWEN_XML, ToolSyntax
from app.pipeline.tools.xml_parser import XmlCallParser

#: The readers of a family's calls (``app/pipeline/tools/``): one interface, ``feed``, ``finish``, ``calls``.
CallParser = ToolCallParser | XmlCallParser | PythonicCallParser | GemmaCallParser


@dataclass(slots=True, frozen=True)
class Reading:
    """How a request's replies are read."""

    #: The syntax of the tool calls a reply may hold; None: it holds none (its text is content).
    calls: ToolSyntax | None = None
    #: Whether the model reasons between ``tags`` first (``<think>``, Gemma 4's channel); ``inside``: the prompt
    #: opened them.
    reasons: bool = False
    inside: bool = False
    tags: Tags = THINK
    #: A reader of the model's own reply format where it has one (gpt-oss's harmony: ``app/pipeline/harmony/``).
    own: Callable[[], Reader] | None = None
    #: The offered tools' parameters' JSON types, by tool and parameter (the XML syntax's values are typed by them).
    types: Mapping[str, Mapping[str, str]] = field(default_factory=dict)

    def reader(self) -> Reader:
        if self.own is not None:
            return self.own()
        calls: CallParser | None = None
        if self.calls is not None:
            readers: dict[str, Callable[[], CallParser]] = {
                QWEN_XML.family: lambda: XmlCallParser(self.types), PYTHONIC.family: PythonicCallParser,
                GEMMA.family: GemmaCallParser,
            }  # fmt: skip
            reader = readers.get(self.calls.family)
            calls = reader() if reader is not None else ToolCallParser(self.calls)
        return ReplyReader(ReasoningParser(self.inside, self.tags) if self.reasons else None, calls)


@dataclass(slots=True)
class Piece:
    """What the next text of a reply released."""

    reasoning: str = ""
    content: str = ""
    #: ``tool_calls`` stream deltas (``ToolCallParser.feed``).
    calls: list[dict[str, Any]] = field(default_factory=list)


class Reader(Protocol):
    """Reads a reply fed piece by piece into reasoning, content and calls."""

    def feed(self, text: str) -> Piece: ...

    def finish(self) -> Piece: ...

    @property
    def content(self) -> str | None: ...

    @property
    def reasoning(self) -> str | None: ...

    @property
    def calls(self) -> list[ParsedCall]: ...


@dataclass(slots=True)
class ReplyReader:
    thinker: ReasoningParser | None
    tools: CallParser | None
    _content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> Piece:
        reasoning, answer = self.thinker.feed(text) if self.thinker is not None else ("", text)
        return self._answer(reasoning, answer)

    def finish(self) -> Piece:
        """At the end of the reply: what was held back, in the order it came."""
        reasoning, answer = self.thinker.finish() if self.thinker is not None else ("", "")
        piece = self._answer(reasoning, answer)
        if self.tools is not None:
            rest, more = self.tools.finish()
            piece.content += rest
            piece.calls += more
        return piece

    def _answer(self, reasoning: str, answer: str) -> Piece:
        if self.tools is None:
            self._content.append(answer)
            return Piece(reasoning, answer)
        content, calls = self.tools.feed(answer)
        return Piece(reasoning, content, calls)

    @property
    def content(self) -> str | None:
        """The reply's content: None when it made calls and said nothing else."""
        return self.tools.text if self.tools is not None else "".join(self._content)

    @property
    def reasoning(self) -> str | None:
        return self.thinker.text if self.thinker is not None else None

    @property
    def calls(self) -> list[ParsedCall]:
        return self.tools.calls if self.tools is not None else []
