from __future__ import annotations

import pytest

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
