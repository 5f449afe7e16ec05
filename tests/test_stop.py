from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.stop import StopMatcher


def run(deltas: list[str], stops: tuple[str, ...], include: bool = False) -> tuple[list[str], bool]:
    matcher = StopMatcher(stops, include)
    out = [matcher.feed(d) for d in deltas]
    out.append(matcher.flush())
    return out, matcher.matched


def test_a_stop_string_spanning_deltas_never_leaks() -> None:
    out, matched = run(["Hello wo", "rl", "d! more"], ("world",))
    assert matched
    assert "".join(out) == "Hello "
    assert all("w" not in piece for piece in out)  # no part of the stop string was released, ever


def test_held_back_text_is_released_when_it_stops_matching() -> None:
    out, matched = run(["ab", "c", "d"], ("cx",))
    assert not matched
    assert out == ["ab", "", "cd", ""]


def test_include_stop_str_in_output_and_earliest_match_wins() -> None:
    out, _ = run(["one two three"], ("three", "two"), include=True)
    assert "".join(out) == "one two"


def test_nothing_after_the_match_and_flush_on_plain_end() -> None:
    matcher = StopMatcher(("\n",))
    assert matcher.feed("line\nnext") == "line"
    assert matcher.feed("more") == ""
    assert matcher.flush() == ""
    assert run(["tail"], ("zz",))[0] == ["tail", ""]


@pytest.mark.parametrize("split", range(1, 12))
def test_any_split_gives_the_same_text(split: int) -> None:
    text = "abc<|end|>def"
    out, matched = run([text[:split], text[split:]], ("<|end|>",))
    assert matched and "".join(out) == "abc"


class _Reference:
    """The plain matcher this one replaced: every stop string searched for in the text at every delta."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops, self.text, self.released, self.matched = stops, "", 0, False

    def feed(self, delta: str) -> str:
        if self.matched:
            return ""
        self.text += delta
        found = [at for stop in self.stops if (at := self.text.find(stop, self.released)) != -1]
        if found:
            self.matched = True
            return self._release(min(found))
        held = max((size for stop in self.stops for size in range(1, len(stop))
                    if self.text.endswith(stop[:size])), default=0)  # fmt: skip
        return self._release(len(self.text) - held)

    def _release(self, end: int) -> str:
        end = max(end, self.released)
        out, self.released = self.text[self.released : end], end
        return out


_ALPHABET = "ab\n<|>é😀"


@settings(max_examples=400, deadline=None)
@given(st.lists(st.text(_ALPHABET, min_size=1, max_size=4), min_size=1, max_size=6, unique=True),
       st.lists(st.text(_ALPHABET, max_size=6), max_size=12))  # fmt: skip
def test_the_automaton_releases_what_searching_every_stop_did(stops: list[str], deltas: list[str]) -> None:
    """Any stop strings (overlapping, nested, sharing prefixes, any script), any split of the text into deltas: the
    same text released at each delta, and the same match, as the search of every stop string in the text."""
    matcher, reference = StopMatcher(tuple(stops)), _Reference(tuple(stops))
    for delta in deltas:
        assert matcher.feed(delta) == reference.feed(delta)
        assert matcher.matched == reference.matched
    assert matcher.flush() == ("" if reference.matched else reference.text[reference.released :])


def test_min_tokens_releases_unsearched_text_and_holds_nothing_of_it() -> None:
    matcher = StopMatcher(("STOP",))
    assert matcher.feed("xxST", check=False) == "xxST"
    assert matcher.feed("ep on") == "ep on"  # nothing of the released text is held back again
    assert matcher.feed(" STOP") == " " and matcher.matched
    late = StopMatcher(("STOP",))
    assert late.feed("xxST", check=False) == "xxST"
    assert late.feed("OP and on") == "" and late.matched  # completed after min_tokens: it stops (as vLLM)


def test_a_token_costs_the_same_with_sixty_four_stop_strings() -> None:
    """The cost per token does not grow with the number of stop strings: 64 long ones against one, same text."""
    import time

    text = [" lorem ipsum dolor"] * 3000

    def run_time(stops: tuple[str, ...]) -> float:
        StopMatcher(stops)  # the automaton built before timing
        best = float("inf")
        for _ in range(3):
            matcher, started = StopMatcher(stops), time.perf_counter()
            for delta in text:
                matcher.feed(delta)
            best = min(best, time.perf_counter() - started)
        return best

    many = tuple(f"{i:02d}" + "lorem ipsum dolor sit amet " * 9 for i in range(64))
    assert run_time(many) < 3 * run_time(("zz",))
