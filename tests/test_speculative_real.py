"""Speculative decoding on the real model: greedy tokens and logprobs bitwise those of decoding without drafts
(``--speculative ngram`` against ``none``), alone and in busy staggered batches, with stop tokens, ``n`` > 1,
preemption in a small KV pool, prefix-cache hits and grammar rows; no block leaked after rejected drafts; seeded
sampling's tokens and logprobs those of decoding without drafts, alone and beside other requests.

Bitwise equality holds while a row's logits do not depend on the rows beside it: the invariant path, which
engines built directly run (``batch_mode.INVARIANT``) and which ``--batch-invariant on`` (or ``auto`` where it
is cheap) serves."""

from __future__ import annotations

import pytest
from engine_helpers import run_outputs
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.speculation import DraftBudget
from engine.core.tokenizer import HFTokenizer
from engine.core.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.real_model

PARAGRAPHS = [
    "The old lighthouse stood at the edge of the cliff for nearly two hundred years. Sailors trusted its light "
    "on stormy nights, and the keeper's family lived in the small stone house beside it, tending the lamp, "
    "painting the railings and writing down every ship that passed in a thick leather book.",
    "Photosynthesis is the process by which green plants use sunlight, water and carbon dioxide to make glucose "
    "and oxygen. It happens mostly in the leaves, inside chloroplasts, which hold the green pigment chlorophyll.",
    "our team meet on monday to discussed the budget, but nobody have brought the numbers, so we decide to "
    "meeting again next week when everyone has did their homework and the report are finished.",
]
TASKS = ["Repeat this paragraph exactly:", "Fix the grammar of this paragraph:", "Summarize this paragraph:"]
FREE = ["Write a short story about a dragon who is afraid of the dark.", "Tell me about the history of Rome."]


class Quiet:
    """A loaded model that prints as its name (hypothesis prints a failing example's arguments)."""

    def __init__(self, loaded) -> None:
        self.__dict__.update({name: getattr(loaded, name) for name in loaded.__dataclass_fields__})

    def __repr__(self) -> str:
        return f"<{self.name}>"


@pytest.fixture(scope="module")
def blocks_model() -> Quiet:
    """The default model as `make serve` loads it: its blocks, dtype ``auto``."""
    from engine.runtime import loader

    return Quiet(loader.load(loader.DEFAULT_MODEL, "auto", blocks=True))


def engine(model, speculative: bool, **overrides: object):
    from engine.runtime.batch_engine import HFEngine

    options = {"capacity": 16, "max_model_len": 2048, "kv_cache_bytes": 1 << 28, "max_num_batched_tokens": 256}
    options.update(overrides)
    drafts = DraftBudget("ngram", options["max_num_batched_tokens"]) if speculative else None
    return HFEngine(
        model.model, eos_token_ids=model.eos_token_ids, quantized=model.blocks, draft_rows=drafts, **options
    )


def chat_ids(model, text: str) -> tuple[int, ...]:
    return tuple(HFTokenizer(model.tokenizer, model.eos_token_ids).chat_prompt([{"role": "user", "content": text}]))


def both(model, arrivals: list[tuple[int, GenerationRequest]], **overrides: object):
    """The outputs without and with drafts, and the speculating engine."""
    plain = run_outputs(engine(model, False, **overrides), arrivals)
    fast = engine(model, True, **overrides)
    return plain, run_outputs(fast, arrivals), fast


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    task=st.integers(0, len(TASKS) - 1),
    paragraph=st.integers(0, len(PARAGRAPHS) - 1),
    repeats=st.integers(1, 3),
    max_tokens=st.integers(8, 96),
    logprobs=st.integers(0, 3),
    busy=st.booleans(),
)
def test_greedy_tokens_and_logprobs_are_bitwise_those_without_drafts(
    blocks_model, task: int, paragraph: int, repeats: int, max_tokens: int, logprobs: int, busy: bool
) -> None:
    """Grounded prompts of several lengths (the paragraph once to three times), alone or staggered among free
    prompts and a second copy of themselves (``n`` = 2)."""
    text = f"{TASKS[task]}\n\n{' '.join([PARAGRAPHS[paragraph]] * repeats)}"
    grounded = GenerationRequest(chat_ids(blocks_model, text), max_tokens, logprobs=logprobs)
    arrivals = [(0, grounded)]
    if busy:
        free = [GenerationRequest(chat_ids(blocks_model, p), 40, logprobs=1) for p in FREE]
        arrivals += [(0, free[0]), (3, grounded), (5, free[1])]
    plain, fast, spec = both(blocks_model, arrivals)
    assert fast == plain
    assert spec.pool.num_in_use == 0


def test_drafts_are_accepted_on_grounded_work_and_every_outcome_matches(blocks_model) -> None:
    """Repeating a paragraph: most tokens come from accepted drafts; stop tokens end it where they would."""
    ids = chat_ids(blocks_model, f"{TASKS[0]}\n\n{PARAGRAPHS[0]}")
    period = blocks_model.tokenizer(".", add_special_tokens=False)["input_ids"][0]
    requests = [
        GenerationRequest(ids, 80, logprobs=2, ignore_eos=True),
        GenerationRequest(ids, 80, stop_token_ids=frozenset({period})),
        GenerationRequest(ids, 80, min_tokens=30, stop_token_ids=frozenset({period})),
    ]
    plain, fast, spec = both(blocks_model, [(i, r) for i, r in enumerate(requests)])
    assert fast == plain
    assert plain[1][-1].token_id == period and len(plain[2]) >= 30
    assert spec.planner.num_accepted > 0.5 * sum(len(out) for out in fast.values())
    assert spec.pool.num_in_use == 0


def test_preemption_in_a_small_pool_keeps_the_tokens_and_leaks_no_block(blocks_model) -> None:
    ids = [chat_ids(blocks_model, f"{TASKS[i % 3]}\n\n{PARAGRAPHS[i % 3]}") for i in range(6)]
    arrivals = [(i, GenerationRequest(prompt, 64, logprobs=1, ignore_eos=True)) for i, prompt in enumerate(ids)]
    config = blocks_model.model.config
    per_position = config.num_hidden_layers * config.num_key_value_heads * 64 * 2 * blocks_model.model.dtype.itemsize
    plain, fast, spec = both(blocks_model, arrivals, max_model_len=256, kv_cache_bytes=320 * per_position)
    assert fast == plain
    assert spec.num_preemptions > 0 and spec.planner.num_accepted > 0
    assert spec.pool.num_in_use == 0


def test_a_prefix_cache_hit_and_a_grammar_row_change_nothing(blocks_model) -> None:
    from engine.core.grammar import Grammars

    grammars = Grammars(HFTokenizer(blocks_model.tokenizer, blocks_model.eos_token_ids))
    ids = chat_ids(blocks_model, f"{TASKS[0]}\n\n{PARAGRAPHS[1]}")
    first = GenerationRequest(ids, 48, logprobs=1)
    again = GenerationRequest(ids, 48, logprobs=1)  # the prompt's blocks are cached by then

    def constrained() -> GenerationRequest:
        return GenerationRequest(ids, 20, constraint=grammars.matcher(grammars.choice([" yes", " no"])))

    outputs = []
    for speculative in (False, True):
        served = engine(blocks_model, speculative)
        outputs.append(run_outputs(served, [(0, first), (0, constrained()), (60, again)]))
        assert served.memory_stats().prefix_hit_tokens > 0
    assert outputs[1] == outputs[0]
    assert outputs[0][0] == outputs[0][2]


def test_seeded_sampling_with_drafts_gives_the_text_without_them(blocks_model) -> None:
    """A seeded request's draws are keyed by each token's index, so verifying a draft draws what decoding one token
    at a time draws: the same text and logprobs, alone and among unseeded sampled and greedy requests."""
    grounded = chat_ids(blocks_model, f"{TASKS[0]}\n\n{PARAGRAPHS[2]}")
    seeded = [
        GenerationRequest(grounded, 64, sampling=SamplingParams(temperature=0.7, top_p=0.95, seed=11), logprobs=1),
        GenerationRequest(grounded, 48, sampling=SamplingParams(temperature=1.0, top_k=20, seed=-5), logprobs=0),
    ]
    others = [
        (2, GenerationRequest(chat_ids(blocks_model, FREE[0]), 40, sampling=SamplingParams(temperature=1.0))),
        (3, GenerationRequest(chat_ids(blocks_model, FREE[1]), 40)),
    ]
    runs = []
    for speculative, batchmates in ((False, []), (True, []), (True, others)):
        served = engine(blocks_model, speculative)
        produced = run_outputs(served, [(0, seeded[0]), (1, seeded[1]), *batchmates])
        runs.append([produced[0], produced[1]])
        assert (served.planner.num_drafted > 0) is speculative
    assert runs[1] == runs[0]
    assert runs[2] == runs[0]
