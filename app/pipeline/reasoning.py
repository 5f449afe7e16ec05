"""Reasoning split out of a reply, for models whose chat template has them think between ``<think>`` and
``</think>`` first (Qwen3, QwQ, DeepSeek-R1 distills, SmolLM3), or in Gemma 4's thought channel
(``<|channel>thought`` ... ``<channel|>``). Torch-free.

The reasoning is what the model writes between the tags; the answer (content, and any tool calls) is what follows
the closing tag. A template may open the reasoning itself, its generation prompt ending in ``<think>`` (the R1
distills): then the reply starts inside it. A reply that does not begin with the opening tag, and was not started
inside one, has no reasoning (Qwen3 with ``chat_template_kwargs: {"enable_thinking": false}`` writes none). White
space just inside the tags and just after the closing one is neither reasoning nor content.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Literal

from app.pipeline.tools.parser import partial_suffix


@dataclass(frozen=True, slots=True)
class Tags:
    """What opens a family's reasoning (``opening``, a token where the vocabulary has it, then ``label``'s text)
    and what closes it."""

    opening: str
    closing: str
    label: str = ""

    @property
    def open(self) -> str:
        return self.opening + self.label

    def grammar(self, tag_ids: tuple[int, int] | None) -> tuple[str, str]:
        """The opening and the closing in llguidance's Lark: tokens (``tag_ids``, where they are), else text."""
        if tag_ids is None:
            return json.dumps(self.open), json.dumps(self.closing)
        label = f" {json.dumps(self.label)}" if self.label else ""
        return f"<[{tag_ids[0]}]>{label}", f"<[{tag_ids[1]}]>"


THINK = Tags("<think>", "</think>")
#: Gemma 4's thought channel.
CHANNEL = Tags("<|channel>", "<channel|>", "thought")
OPEN, CLOSE = THINK.open, THINK.closing


def reasons(template: str | None) -> Tags | None:
    """The tags a chat template has its model reason between; None where it has it not reason."""
    for tags in (CHANNEL, THINK):
        if template is not None and tags.open in template and tags.closing in template:
            return tags
    return None


def starts_inside(prompt_text: str, tags: Tags = THINK) -> bool:
    """Whether a rendered prompt (its end) opens the reasoning the reply continues."""
    return prompt_text.rstrip().endswith(tags.open)


def budget_grammar(budget: int, inside: bool, tag_ids: tuple[int, int] | None, tags: Tags = THINK) -> str:
    """A grammar (llguidance's Lark) that ends the reasoning after at most ``budget`` tokens: the closing tag comes
    then, if the model has not written it before; the answer after it is free. ``inside``: the prompt opened the
    reasoning; else the reply may open it or answer at once. ``tag_ids``: the tags' token ids, where they are
    tokens (else the tags are text)."""
    opening, closing = tags.grammar(tag_ids)
    start = "start: thought answer" if inside else f"start: ({opening} thought)? answer"
    return "\n".join([
        start,
        f"thought: reasoning {closing}",
        f"reasoning[max_tokens={budget}]: /(.|\\n)*/",
        "answer: /(.|\\n)*/",
    ])  # fmt: skip


def after_thought(grammar: str, inside: bool, tag_ids: tuple[int, int] | None, tags: Tags = THINK) -> str:
    """A grammar (llguidance's Lark, its ``start`` rule on a line of its own) that holds the answer only: the
    reasoning before it is free and ends with the closing tag (``inside``: the prompt opened it; else the reply may
    open it or answer at once), a line break or two after it. As vLLM holds a reasoning model's tool calls and
    structured outputs: after its reasoning, which they would otherwise be forced into."""
    opening, closing = tags.grammar(tag_ids)
    lines = ["answer: " + line.removeprefix("start: ") if line.startswith("start: ") else line
             for line in grammar.splitlines()]  # fmt: skip
    start = "start: thought answer" if inside else f"start: ({opening} thought)? answer"
    if tag_ids:  # a token ends the text: no text spells it
        thought = [f'thought: REASONING {closing} ("\\n" | "\\n\\n")?', "REASONING: /(.|\\n)*/"]
    else:  # the tag is text: the reasoning ends at its first spelling
        thought = ['thought: reasoning ("\\n" | "\\n\\n")?', f"reasoning[lazy]: /(.|\\n)*/ {closing}"]
    return "\n".join([*lines, start, *thought]) + "\n"


@dataclass(slots=True)
class ReasoningParser:
    """Splits a reply, fed piece by piece, into reasoning and content. Fed the same text in any split, it releases
    the same reasoning and content."""

    inside: bool = False  # the prompt opened the reasoning
    tags: Tags = THINK
    reasoning: list[str] = field(default_factory=list)
    _pending: str = ""
    _state: Literal["start", "reasoning", "after", "content"] = "start"
    _reasoned: bool = False  # reasoning other than white space has been released

    def __post_init__(self) -> None:
        if self.inside:
            self._state = "reasoning"

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that ``text`` releases."""
        self._pending += text
        thought, said = "", ""
        while True:
            match self._state:
                case "start":
                    if not self._start():
                        break
                case "reasoning":
                    done, released = self._reason()
                    thought += released
                    if not done:
                        break
                case "after":  # white space after the closing tag waits for the answer
                    stripped = self._pending.lstrip()
                    if not stripped:
                        break
                    self._pending, self._state = stripped, "content"
                case "content":
                    said, self._pending = said + self._pending, ""
                    break
        self.reasoning.append(thought)
        return thought, said

    def finish(self) -> tuple[str, str]:
        """At the end of the reply: what is still held back (the reply was cut short, or had no answer)."""
        rest, self._pending = self._pending, ""
        if self._state == "start":
            return "", rest
        if self._state == "reasoning":
            rest = rest.rstrip() if self._reasoned else ""
            self.reasoning.append(rest)
            return rest, ""
        return "", ""

    @property
    def text(self) -> str | None:
        """All the reasoning; None where the reply had none."""
        return "".join(self.reasoning) or None

    def _start(self) -> bool:
        """Before anything: the opening tag (then reasoning), or the answer. False: wait for more."""
        stripped, opening = self._pending.lstrip(), self.tags.open
        if stripped.startswith(opening):
            self._pending, self._state = stripped[len(opening) :], "reasoning"
            return True
        if opening.startswith(stripped):
            return False
        self._state = "content"
        return True

    def _reason(self) -> tuple[bool, str]:
        """Reasoning up to the closing tag (True: it came), holding back what may begin the tag and trailing
        white space (which the tag may follow)."""
        closing = self.tags.closing
        end = self._pending.find(closing)
        if end >= 0:
            released = self._released(self._pending[:end].rstrip())
            self._pending, self._state = self._pending[end + len(closing) :], "after"
            return True, released
        cut = len(self._pending) - partial_suffix(self._pending, closing)
        body = self._pending[:cut]
        keep = len(body) - len(body.rstrip())
        released = self._released(body[: len(body) - keep])
        self._pending = self._pending[len(body) - keep :]
        return False, released

    def _released(self, text: str) -> str:
        """Reasoning to release: none of the white space before its first word."""
        if not self._reasoned:
            text = text.lstrip()
            self._reasoned = bool(text)
        return text
