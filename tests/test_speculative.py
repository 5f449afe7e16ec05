"""Speculative decoding without the model: prompt-lookup drafts, draft lengths, the auto budget, the planner's
verification and rollback (on the fake engine), rejection sampling's distribution, and what a client sees."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.batch_mode import PathTimes
from engine.core.drafter import (
    MAX_DRAFT,
    MAX_NGRAM,
    MIN_NGRAM,
    POPULATION_DECAY,
    DraftLength,
    DraftRecord,
    NgramDrafter,
)
from engine.core.fake_engine import FakeEngine
from engine.core.speculation import DraftBudget, StepCost, StepOverhead, choose, step_cost
from engine.core.types import GenerationRequest

# -- drafts -------------------------------------------------------------------------------------------------


def test_a_draft_is_what_followed_the_latest_earlier_occurrence_of_the_suffix() -> None:
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 7, 1, 2, 3]
    assert NgramDrafter().propose(tokens, 3) == [5, 7, 1]  # "1 2 3" last seen before the end at 5..7
    assert NgramDrafter().propose(tokens, 1) == [5]
    assert NgramDrafter().propose([1, 2, 3, 4, 5], 4) == []  # "4 5" never occurred before
    assert NgramDrafter().propose(tokens, 0) == []


def test_a_longer_suffix_wins_over_a_more_recent_shorter_one() -> None:
    tokens = [7, 8, 9, 1, 5, 5, 8, 9, 2, 7, 8, 9]
    # "7 8 9" occurred at the start (then 1); "8 9" more recently (then 2): the longer match is the better guess.
    assert NgramDrafter().propose(tokens, 2) == [1, 5]


def occurrences(tokens: list[int], draft: list[int]) -> bool:
    """Whether some earlier occurrence of a suffix of ``tokens`` (of MIN_NGRAM..MAX_NGRAM tokens) is followed
    by ``draft``."""
    end = len(tokens)
    for n in range(MIN_NGRAM, MAX_NGRAM + 1):
        suffix = tokens[end - n :]
        for stop in range(n, end):
            if tokens[stop - n : stop] == suffix and tokens[stop : stop + len(draft)] == draft:
                return True
    return False


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=0, max_size=60), st.integers(0, MAX_DRAFT), st.integers(1, 20))
def test_drafts_are_continuations_of_an_earlier_occurrence_and_the_index_grows_with_the_text(
    tokens: list[int], limit: int, grow_by: int
) -> None:
    """Property: a draft is never longer than asked, always copies what followed an earlier occurrence of the
    text's suffix, is empty only when no suffix of MIN_NGRAM tokens occurred before, and a drafter that saw
    the text grow in pieces drafts as one that sees it whole."""
    draft = NgramDrafter().propose(tokens, limit)
    assert len(draft) <= limit
    if draft:
        assert occurrences(tokens, draft)
    elif limit and len(tokens) > MIN_NGRAM:
        suffix = tokens[-MIN_NGRAM:]
        assert all(tokens[s - MIN_NGRAM : s] != suffix for s in range(MIN_NGRAM, len(tokens)))
    growing = NgramDrafter()
    for end in range(0, len(tokens), grow_by):
        growing.propose(tokens[:end], limit)
    assert growing.propose(tokens, limit) == draft


def test_draft_length_grows_while_accepted_shrinks_when_cut_and_rests_after_misses() -> None:
    length = DraftLength()
    first = length.next()
    length.record(first, first)
    assert length.next() == first + 2
    length.record(first + 2, 1)
    assert length.next() == 2
    for _ in range(3):
        length.record(length.next(), 0)
    assert [length.next() for _ in range(8)] == [0] * 8  # resting
    assert length.next() == 1
    assert (length.drafted, length.accepted) == (first + first + 2 + 2 + 1 + 1, first + 1)


# -- when -------------------------------------------------------------------------------------------------


def times(invariant: tuple[float, ...], dense: tuple[float, ...] | None = None) -> PathTimes:
    rows = (1, 2, 4, 6, 8, 16, 32, 64)[: len(invariant)]
    return PathTimes(rows, invariant, dense or invariant, True)


#: The probe on a Sapphire Rapids machine (ms): the quantized kernel, and oneDNN's dense bfloat16 path.
QUANTIZED = (6.2, 6.6, 7.1, 9.5, 13.7, 23.4, 41.7, 79.0)
DENSE = (16.4, 16.0, 14.5, 16.0, 18.8, 30.1, 25.0, 32.8)


def test_the_step_cost_interpolates_the_probe_and_extends_it() -> None:
    cost = step_cost(times(QUANTIZED), invariant=True)
    assert cost(1) == 6.2 and cost(3) == pytest.approx(6.85) and cost(12) == pytest.approx(18.55)
    assert cost(128) == pytest.approx(79.0 + (79.0 - 41.7) / 32 * 64)
    off = step_cost(times(QUANTIZED, DENSE), invariant=False)  # the faster path at each size
    assert off(64) == 32.8 and off(4) == 7.1


def test_auto_drafts_by_expected_speed() -> None:
    budget = choose("auto", times(QUANTIZED), True, 256)
    assert isinstance(budget, DraftBudget)
    # One stream: the likelier its tokens, the longer its draft; a sequence that has not drafted yet (0.5) some.
    assert budget.allocate(1, [(8, 0.95, 0.95)]) > budget.allocate(1, [(8, 0.75, 0.75)])
    assert budget.allocate(1, [(8, 0.75, 0.75)]) >= budget.allocate(1, [(8, 0.5, 0.5)])
    # A draft whose later tokens are likelier (a repeated passage) goes further than one as likely throughout.
    assert budget.allocate(1, [(8, 0.7, 0.95)])[0] > budget.allocate(1, [(8, 0.7, 0.7)])[0]
    assert budget.allocate(1, [(8, 0.5, 0.5)])[0] >= 1
    assert budget.allocate(1, [(2, 0.99, 0.99)]) == [2]  # never more than the proposal holds
    # Eight streams on the quantized kernel: each row costs nearly a token's share: only likely drafts go.
    assert sum(budget.allocate(8, [(8, 0.35, 0.35)] * 8)) == 0
    likely = budget.allocate(8, [(8, 0.95, 0.95)] * 4 + [(8, 0.3, 0.3)] * 4)
    assert sum(likely[:4]) > 0 and sum(likely[4:]) == 0
    # With invariance off, large steps take the dense path, where rows are cheap: drafts pay at 32 streams.
    off = choose("auto", times(QUANTIZED, DENSE), False, 256)
    likely32 = [(8, 0.8, 0.8)] * 32
    assert off is not None and sum(off.allocate(32, likely32)) > sum(budget.allocate(32, likely32))
    assert sum(off.allocate(250, [(8, 0.99, 0.99)] * 10)) <= 6  # within the step's token budget


def test_the_overhead_beyond_the_matmuls_is_fitted_from_decoding_steps() -> None:
    overhead = StepOverhead()
    assert overhead(10) == 0.0  # nothing measured: the probe alone
    for rows in [1, 4, 9, 2, 6, 3] * 10:
        overhead.observe(rows, 2.0 + 0.5 * rows)
    assert overhead(10) == pytest.approx(7.0) and overhead(40) == pytest.approx(22.0)
    steady = StepOverhead()
    for _ in range(20):
        steady.observe(8, 3.0)  # the rows never varied: a fixed cost per step, whatever the rows
    assert steady(8) == pytest.approx(3.0) and steady(30) == pytest.approx(3.0)


def test_auto_drafts_by_what_steps_really_take() -> None:
    """Rows that cost more than the probe says (attention, sampling: ~0.5 ms a row at 32 streams) stop drafts of
    unlikely tokens that the probe's cheap dense rows invited; a fixed cost per step makes one stream's drafts
    longer, as each step's share of it is spread over more tokens."""
    measured = choose("auto", times(QUANTIZED, DENSE), False, 256)
    assert measured is not None
    unlikely = [(8, 0.4, 0.4)] * 32
    assert sum(measured.allocate(32, unlikely)) > 0
    for rows in [32, 40, 48, 36, 60, 44] * 10:
        measured.observe(rows, measured.cost(rows) + 0.5 * rows)  # type: ignore[misc]
    assert sum(measured.allocate(32, unlikely)) == 0
    assert sum(measured.allocate(32, [(8, 0.97, 0.97)] * 32)) > 0  # near-certain drafts still pay
    one = choose("auto", times(QUANTIZED), True, 256)
    assert one is not None
    before = one.allocate(1, [(8, 0.8, 0.8)])[0]
    for rows in [1, 4, 3, 5, 2] * 10:
        one.observe(rows, one.cost(rows) + 4.0)  # type: ignore[misc]
    assert one.allocate(1, [(8, 0.8, 0.8)])[0] > before


def test_auto_looks_past_a_jump_in_the_step_s_cost() -> None:
    """The kernel's row tiles make a step's cost rise in jumps: the 4th draft token (5 rows) alone costs more than it
    brings, but with the three after it the step is faster; a draft that stops before the jump is kept short."""
    jumpy = DraftBudget("auto", 256, StepCost((1, 4, 5, 8), (6.0, 7.0, 10.0, 11.0)))
    assert jumpy.allocate(1, [(8, 0.95, 0.95)]) == [8]  # 7.0 expected tokens in 11.3: past the jump at 5 rows
    assert jumpy.allocate(1, [(8, 0.6, 0.3)]) == [2]


def test_auto_does_not_draft_at_the_break_even() -> None:
    """A step of 32 rows whose one drafted token would raise its expected speed by 0.1%: within the estimates'
    error, and lookups and commits cost outside them, so nothing is drafted; at one row the same drafts pay."""
    linear = DraftBudget("auto", 256, StepCost((1, 100), (11.0, 110.0)))  # 10 per step, 1 per row
    assert linear.allocate(32, [(1, 0.8, 0.8)]) == [0]
    assert linear.allocate(1, [(8, 0.95, 0.95)]) == [8]


def test_a_new_sequence_starts_from_what_drafts_have_done_lately() -> None:
    population = DraftRecord(POPULATION_DECAY)
    veteran = DraftLength(population=population)
    for _ in range(20):
        veteran.record(8, 8)
    newcomer = DraftLength(population=population)
    assert min(newcomer.rates) > 0.8 > 0.5 == max(DraftLength().rates)
    for _ in range(6):
        newcomer.record(8, 0)  # its own record soon outweighs the prior
    assert newcomer.rates[0] < 0.3


def test_ngram_drafts_what_each_sequence_offers_within_the_step_and_the_other_modes_do_as_told() -> None:
    ngram = choose("ngram", None, True, 20)
    assert ngram is not None and ngram.allocate(10, [(4, 0.1, 0.1), (4, 0.9, 0.9), (4, 0.5, 0.5)]) == [4, 4, 2]
    assert choose("auto", None, True, 256) is None  # no probe: transformers' own model, nothing measured
    assert choose("none", times(QUANTIZED), True, 256) is None
    with pytest.raises(ValueError, match="--speculative"):
        choose("eagle", None, True, 256)


def test_a_sequence_s_acceptance_rates_follow_its_recent_drafts() -> None:
    length = DraftLength()
    assert length.rates == (0.5, 0.5)
    for _ in range(6):
        length.record(4, 4)
    assert min(length.rates) > 0.8
    for _ in range(12):
        length.record(4, 0)
    first, later = length.rates
    assert first < 0.2 < 0.5 < later  # rejected at once: later tokens untried, their record fades to the prior
    repeats = DraftLength()
    for accepted in [0, 8, 0, 8, 8, 0, 8, 8]:  # a passage repeated: a draft is wrong at once or right to its end
        repeats.record(8, accepted)
    first, later = repeats.rates
    assert 0.5 < first < 0.8 and later > 0.9


# -- the planner, on the fake engine ------------------------------------------------------------------------


def run(engine: FakeEngine, requests: list[GenerationRequest]) -> tuple[dict[int, list[int]], int]:
    """Each request's tokens (all admitted at once) and the steps it took; every step checks the blocks."""
    ids = engine.admit(requests)
    produced: dict[int, list[int]] = {seq_id: [] for seq_id in ids}
    steps = 0
    while engine.num_active():
        for out in engine.step():
            produced[out.seq_id].extend(out.token_ids)
        steps += 1
        planner = engine.planner
        for seq in planner.seqs.values():  # a rejected draft's blocks went back: none past the next position
            assert len(seq.blocks.blocks) <= planner.ledger.blocks_for(seq.num_computed + 1)
            assert len(seq.blocks.hashes) * planner.ledger.block_size <= seq.num_computed
    assert engine.planner.pool.num_in_use == 0
    return [produced[i] for i in ids], steps


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 60), st.integers(1, 90)), min_size=1, max_size=5),
    st.one_of(st.none(), st.integers(2, 70)),
)
def test_speculation_gives_the_same_tokens_in_fewer_steps_and_leaks_no_block(
    shapes: list[tuple[int, int]], eos_after: int | None
) -> None:
    requests = [
        GenerationRequest(tuple(97 + i % 26 for i in range(prompt)), max_tokens) for prompt, max_tokens in shapes
    ]
    plain, plain_steps = run(FakeEngine(eos_after=eos_after), requests)
    fast = FakeEngine(eos_after=eos_after, speculative=True)
    drafted, drafted_steps = run(fast, requests)
    assert drafted == plain
    assert drafted_steps <= plain_steps
    stats = fast.memory_stats()
    assert 0 <= stats.accepted_tokens <= stats.drafted_tokens
    if max(len(t) for t in plain) > 40:  # the alphabet repeats after 26 letters: drafts of it are accepted
        assert stats.accepted_tokens > 0 and drafted_steps < plain_steps


def test_drafts_stop_short_of_max_tokens_and_skip_grammar_rows_and_min_tokens() -> None:
    engine = FakeEngine(speculative=True)
    prompt = tuple(b"abcdefghijklmnopqrstuvwxyz" * 2)
    (tokens,), _ = run(engine, [GenerationRequest(prompt, 30)])
    assert len(tokens) == 30
    engine = FakeEngine(speculative=True)
    run(engine, [GenerationRequest(prompt, 30, min_tokens=30)])
    assert engine.memory_stats().drafted_tokens == 0  # before min_tokens no draft: EOS is banned row by row


# -- what a client sees ----------------------------------------------------------------------------------


@pytest.fixture
def speculative_client():
    from app_helpers import fake_client

    with fake_client(FakeEngine(speculative=True, max_model_len=512)) as client:
        yield client


@pytest.fixture
def plain_client():
    from app_helpers import fake_client

    with fake_client(FakeEngine(max_model_len=512)) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_inside_a_multi_token_step_ends_the_text_and_the_count_there(
    speculative_client, plain_client, stream: bool
) -> None:
    """Several tokens arrive in one step; the stop string falls among them: text, finish reason and
    completion_tokens are what they are without speculation."""
    from app_helpers import sse_chunks

    body = {"model": "fake", "prompt": "abcdefghijklmnopqrstuvwxyz" * 2, "max_tokens": 60, "stop": ["jk"],
            "stream": stream, **({"stream_options": {"include_usage": True}} if stream else {})}  # fmt: skip
    answers = []
    for client in (speculative_client, plain_client):
        if stream:
            chunks = sse_chunks(client, body)
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            answers.append((text, [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"],
                            chunks[-1]["usage"]))  # fmt: skip
        else:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200
            choice = response.json()["choices"][0]
            answers.append((choice["text"], choice["finish_reason"], response.json()["usage"]))
    assert answers[0] == answers[1]
    text, finish, usage = answers[0]
    assert text == "abcdefghi" and finish == "stop" and usage["completion_tokens"] == 11


def test_the_access_log_and_metrics_count_accepted_tokens(speculative_client, caplog: pytest.LogCaptureFixture) -> None:
    body = {"model": "fake", "prompt": "abcdefghijklmnopqrstuvwxyz" * 2, "max_tokens": 50}
    with caplog.at_level(logging.INFO, logger="smolserve.access"):
        response = speculative_client.post("/v1/completions", json=body)
    choice = response.json()["choices"][0]
    assert response.json()["usage"]["completion_tokens"] == 50
    assert choice["text"] == ("abcdefghijklmnopqrstuvwxyz" * 2)[:50]
    logged = [r.getMessage() for r in caplog.records if "/v1/completions" in r.getMessage()]
    accepted = int(logged[-1].split("accepted_tokens=")[1].split()[0])
    assert accepted > 20  # most of the alphabet after its first round came from drafts
    metrics = speculative_client.get("/metrics").text
    drafted = [line for line in metrics.splitlines() if line.startswith("smolserve:spec_decode_num_draft_tokens")]
    taken = [line for line in metrics.splitlines() if line.startswith("smolserve:spec_decode_num_accepted_tokens")]
    assert float(taken[0].split()[-1]) == accepted <= float(drafted[0].split()[-1])
