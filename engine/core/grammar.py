"""Constrained decoding: grammars compiled by llguidance, one matcher per sequence. Torch-free.

A request that asks for structured output carries a ``Matcher`` (``engine.core.types.Constraint``): each step the
engine masks its row's logits to the tokens the matcher allows, then hands it the token chosen. Compiling a
grammar (a JSON schema, a regex, a Lark grammar) happens once per distinct grammar, in the HTTP layer before
admission, so that a bad grammar is a 400 and never a failure inside a step; each sequence then takes a copy of
the compiled matcher (microseconds). Why llguidance and not xgrammar: it has no dependencies (xgrammar pulls in
triton and torch), computes a mask in tens of microseconds, and rejects JSON-schema keywords it does not
implement instead of dropping them.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import llguidance

from engine.core.tokenizer import HFTokenizer, Tokenizer

# JSON spelled as Python's json.dumps spells it (", " and ": ", no other white space): the style models saw most.
# Free white space lets a small model spend its budget on it; compact JSON ("," and ":") is further from what
# it learned: of six JSON-mode prompts to SmolLM2-135M (greedy, 200 tokens), 4 closed their object in this
# style, 3 with free white space, 2 compact.
JSON_STYLE: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """The grammar (or schema) cannot be compiled; the message says why."""


class Matcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def allowed_tokens(self) -> bytes:
        return self._matcher.compute_bitmask()

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)

    @property
    def is_done(self) -> bool:
        """Complete (only EOS may follow, or it came), or broken: either way nothing more may be generated."""
        return self._matcher.is_stopped()


class Grammars:
    """Compiles grammars for one tokenizer and keeps the last ``max_cached`` compiled ones."""

    def __init__(self, tokenizer: Tokenizer, max_cached: int = 64) -> None:
        self._tokenizer = tokenizer
        self._ll_tokenizer: llguidance.LLTokenizer | None = None  # made on first use (~0.5 s): not at start-up
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()  # compiled off the event loop, in any worker thread

    @staticmethod
    def json_schema(schema: dict[str, Any] | bool) -> str:
        """The grammar of JSON text that conforms to ``schema``."""
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        except ValueError as exc:
            raise GrammarError(str(exc)) from None

    @staticmethod
    def regex(pattern: str) -> str:
        return llguidance.LLMatcher.grammar_from_regex(pattern)

    @staticmethod
    def lark(grammar: str) -> str:
        return llguidance.LLMatcher.grammar_from_lark(grammar)

    @staticmethod
    def choice(options: list[str]) -> str:
        """Exactly one of ``options``."""
        return Grammars.lark("start: " + " | ".join(json.dumps(option, ensure_ascii=False) for option in options))

    @staticmethod
    def check(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
        """Raises GrammarError when ``grammar`` cannot compile (for ``tokenizer``, or for any tokenizer: cheap,
        no token masks)."""
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise GrammarError("; ".join(messages))

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher at the start of ``grammar``; compiles it on first use (up to ~1 s for a large one:
        call off the event loop)."""
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is None:
                compiled = self._compile(grammar)
                self._compiled[grammar] = compiled
                if len(self._compiled) > self._max_cached:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return Matcher(compiled.deep_copy())

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = _ll_tokenizer(self._tokenizer)
        self.check(grammar, self._ll_tokenizer)
        matcher = llguidance.LLMatcher(self._ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher


def _ll_tokenizer(tokenizer: Tokenizer) -> llguidance.LLTokenizer:
    eos = sorted(tokenizer.eos_token_ids)
    if isinstance(tokenizer, HFTokenizer) and getattr(tokenizer.hf_tokenizer, "is_fast", False):
        from llguidance.hf import from_tokenizer  # imports transformers: only for a transformers tokenizer

        return from_tokenizer(tokenizer.hf_tokenizer, eos_token=eos)
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, eos[0])))


class _ByteVocabulary:
    """Any tokenizer as llguidance's generic wrapper reads one: every token's bytes, and an encoder."""

    def __init__(self, tokenizer: Tokenizer, eos: int) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = eos
        self.bos_token_id = None
        self.tokens = [tokenizer.token_bytes(t) for t in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.eos_token_ids)

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)
