"""Structured output: grammars compiled once, a matcher per sequence, masks applied inside the shared batch."""

from __future__ import annotations

import pytest
import torch

from engine.core.grammar import GrammarError, Grammars
from engine.core.tokenizer import ByteTokenizer
from engine.core.types import GREEDY, SamplingParams
from engine.runtime.sampler import Row, select_tokens

BYTES = ByteTokenizer()


def allowed(matcher) -> set[int]:
    mask = matcher.allowed_tokens()
    return {t for t in range(BYTES.vocab_size) if mask[t // 8] >> (t % 8) & 1}


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    return Grammars(BYTES)


def test_a_json_object_opens_closes_and_ends_the_sequence(grammars: Grammars) -> None:
    matcher = grammars.matcher(grammars.json_schema({"type": "object"}))
    assert allowed(matcher) == {ord("{")}
    matcher.accept(ord("{"))
    assert allowed(matcher) == {ord('"'), ord("}")}  # compact JSON: no free whitespace to loop on
    assert not matcher.is_done
    matcher.accept(ord("}"))
    assert matcher.is_done and allowed(matcher) == {ByteTokenizer.EOS}


def test_each_sequence_has_its_own_matcher_from_one_compiled_grammar(grammars: Grammars) -> None:
    grammar = grammars.choice(["yes", "no"])
    first, second = grammars.matcher(grammar), grammars.matcher(grammar)
    first.accept(ord("y"))
    assert allowed(first) == {ord("e")} and allowed(second) == {ord("y"), ord("n")}


@pytest.mark.parametrize(
    "schema",
    [{"type": "frobnicate"}, {"type": "string", "format": "no-such-format"}, {"type": "object", "minProperties": "x"}],
)
def test_a_schema_it_cannot_enforce_is_refused_not_dropped(grammars: Grammars, schema: dict) -> None:
    with pytest.raises(GrammarError):
        grammars.matcher(grammars.json_schema(schema))


def test_a_broken_regex_or_grammar_is_refused(grammars: Grammars) -> None:
    with pytest.raises(ValueError):
        grammars.matcher(grammars.regex("(unclosed"))
    with pytest.raises(ValueError):
        grammars.matcher(grammars.lark("start: undefined_rule"))


def test_only_constrained_rows_are_masked_whatever_their_sampling(grammars: Grammars) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, BYTES.vocab_size)
    logits[:, ord("a")] = 50.0  # every row's favourite, which the grammar forbids
    rows = [
        Row(GREEDY, constraint=grammars.matcher(grammars.choice(["{x}"]))),
        Row(SamplingParams(temperature=1.5, logit_bias=((ord("a"), 100.0),)),
            constraint=grammars.matcher(grammars.choice(["{y}"]))),
        Row(SamplingParams(temperature=1.0, top_p=0.5, presence_penalty=2.0), output_ids=[ord("a")],
            constraint=grammars.matcher(grammars.choice(["{z}"]))),
        Row(GREEDY),
    ]  # fmt: skip
    tokens, _ = select_tokens(logits, rows)
    assert tokens.tolist() == [ord("{"), ord("{"), ord("{"), ord("a")]
