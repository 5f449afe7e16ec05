"""A harmony reply read as it streams, by openai-harmony's ``StreamableParser``: ``analysis`` is reasoning, a
message addressed ``to=functions.NAME`` a call of NAME (its text the arguments), anything else (``final``, a
``commentary`` preamble) content. The text keeps the markers' spelling (``Harmony.marker_ids``), so the reader
encodes each piece again to tokens: the parser sees the markers where the model wrote them, and the same messages
whatever the split. A reply that leaves harmony's shape (a model that writes plain text) is content from there on."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from openai_harmony import HarmonyError, Role, StreamableParser, StreamState

from app.pipeline.harmony.encoding import Harmony
from app.pipeline.reply import Piece
from app.pipeline.tools.parser import ParsedCall, add_arguments

#: Where a message's recipient names one of the request's functions.
FUNCTIONS = "functions."
#: The longest header waited for (``<|channel|>commentary to=functions.NAME <|constrain|>json`` is short): past it
#: the model is writing text outside harmony's shape, released as content rather than held to the reply's end.
MAX_HEADER = 512


@dataclass(slots=True)
class HarmonyReader:
    harmony: Harmony
    #: The reply's first tokens that the prompt already holds (an assistant prefill's header and text).
    primed: tuple[int, ...] = ()
    calls: list[ParsedCall] = field(default_factory=list)
    _reasoning: list[str] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _parser: StreamableParser | None = None  # None once the reply left harmony's shape
    _header: list[str] = field(default_factory=list)  # the text of the message header being read
    _in_message: bool = False

    def __post_init__(self) -> None:
        self._parser = StreamableParser(self.harmony.encoding, role=Role.ASSISTANT)
        for token in self.primed:
            self._parser.process(token)
        self._in_message = self._parser.state == StreamState.CONTENT

    def feed(self, text: str) -> Piece:
        piece = Piece()
        tokens = self.harmony.encoding.encode(text, allowed_special="all")
        for index, token in enumerate(tokens):
            if self._parser is None:
                self._say(piece, self.harmony.encoding.decode(tokens[index:]))
                break
            self._read(token, piece)
        return piece

    def finish(self) -> Piece:
        """At the end: a header never followed by a message was text the model wrote outside harmony's shape."""
        piece = Piece()
        if self._parser is not None and not self._in_message:
            self._say(piece, "".join(self._header))
        self._header.clear()
        return piece

    @property
    def content(self) -> str | None:
        """The reply's content: None when it made calls and said nothing else."""
        content = "".join(self._content)
        return None if self.calls and not content else content

    @property
    def reasoning(self) -> str | None:
        return "".join(self._reasoning) or None

    def _read(self, token: int, piece: Piece) -> None:
        assert self._parser is not None
        try:
            self._parser.process(token)
        except HarmonyError:
            self._leave(piece, self.harmony.encoding.decode([token]))
            return
        state = self._parser.state
        if state == StreamState.HEADER:
            self._header.append(self.harmony.encoding.decode([token]))
            if sum(map(len, self._header)) > MAX_HEADER:
                self._leave(piece, "")
        elif state == StreamState.EXPECT_START:
            self._header.clear()
            self._in_message = False
        elif state == StreamState.CONTENT:
            self._content_of(piece)

    def _content_of(self, piece: Piece) -> None:
        """The message's next text, where its header says it goes; a call's first delta when its message begins."""
        assert self._parser is not None
        recipient = self._parser.current_recipient
        if not self._in_message:
            self._in_message = True
            self._header.clear()
            if recipient is not None:
                call = ParsedCall(f"call_{uuid.uuid4().hex[:24]}", recipient.removeprefix(FUNCTIONS))
                piece.calls.append({"index": len(self.calls), **call.as_dict()})
                self.calls.append(call)
        delta = self._parser.last_content_delta or ""
        if not delta:
            return
        if recipient is not None:
            self.calls[-1].arguments += delta
            add_arguments(piece.calls, len(self.calls) - 1, delta)
        elif self._parser.current_channel == "analysis":
            self._reasoning.append(delta)
            piece.reasoning += delta
        else:
            self._say(piece, delta)

    def _leave(self, piece: Piece, text: str) -> None:
        """The reply left harmony's shape: the header read so far and ``text`` are content, as is all that follows."""
        self._parser = None
        self._say(piece, "".join(self._header) + text)
        self._header.clear()

    def _say(self, piece: Piece, text: str) -> None:
        self._content.append(text)
        piece.content += text
