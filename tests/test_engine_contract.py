"""The engine seam's contract, run against every implementation: the fake and the real HF engine, and a runtime
that implements only a runner's part (``run``) below the core's planned engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.core.block_pool import BlockPool
from engine.core.blocks import BlockLedger
from engine.core.config import BLOCK_SIZE
from engine.core.fake_engine import FakeEngine
from engine.core.planned_engine import PlannedEngine, StepTokens
from engine.core.planner import Plan, Planner
from engine.core.seam import InferenceEngine
from engine.core.types import GenerationRequest, StepOutput

MAX_MODEL_LEN = 64


def _fake() -> InferenceEngine:
    return FakeEngine(capacity=4, max_model_len=MAX_MODEL_LEN)


def _hf(tiny_llama_dir: str) -> InferenceEngine:
    from transformers import AutoModelForCausalLM

    from engine.runtime.batch_engine import HFEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    return HFEngine(
        model,
        eos_token_ids=frozenset({7}),
        capacity=4,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_bytes=1 << 24,
        max_num_batched_tokens=32,
    )


class _DictTier:
    """A tier below the pool in a dict (its blocks' digests only), counting the steps that hand blocks over."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.offered: list[bytes] = []
        self.steps = 0

    def pays(self) -> bool:
        return True

    def has(self, digest: bytes) -> bool:
        return digest in self.held

    def load(self, digest: bytes, block: int) -> bool:
        return digest in self.held

    def store(self, digest: bytes, block: int) -> None:
        self.offered.append(digest)

    def end_step(self) -> None:
        self.steps += 1
        self.held.update(self.offered)
        self.offered.clear()


class _RunnerOnly(PlannedEngine):
    """A runtime with a runner's part only: each sampled sequence's next token is 100 + its tokens so far."""

    def __init__(self) -> None:
        self.tier = _DictTier()
        self.runs = 0
        ledger = BlockLedger(BlockPool(4 * MAX_MODEL_LEN // BLOCK_SIZE, BLOCK_SIZE), 4, lower=self.tier)
        self.planner = Planner(ledger, capacity=4, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=32,
                               eos_token_ids=frozenset({7}))  # fmt: skip

    def run(self, plan: Plan) -> StepTokens:
        self.runs += 1
        return [[(100 + len(seq.output_ids), None)] for seq in plan.sampled]


@pytest.fixture(params=["fake", "hf", "runner-only"])
def engine(request: pytest.FixtureRequest, tiny_llama_dir: str) -> InferenceEngine:
    if request.param == "runner-only":
        return _RunnerOnly()
    return _fake() if request.param == "fake" else _hf(tiny_llama_dir)


def test_the_core_plans_runs_and_commits_and_hands_each_step_s_blocks_below_together() -> None:
    """Below the core a runtime's ``run`` is all a step needs; the blocks a step fills reach the tier below memory
    in one hand-off a step, and a newcomer's prefix is found there once the pool has let it go."""
    engine = _RunnerOnly()
    prompt = GenerationRequest(tuple(range(10, 10 + 2 * BLOCK_SIZE + 3)), 4, True)  # two steps' chunks (32 a step)
    engine.admit([prompt])
    outputs = run_until_idle(engine)
    assert [t for o in outputs for t in o.token_ids] == [100, 101, 102, 103]
    assert engine.tier.steps == engine.runs == 5 and len(engine.tier.held) == 2 and not engine.tier.offered
    engine.reset()  # the pool forgets; the tier below keeps
    engine.admit([prompt])
    again = run_until_idle(engine)
    assert [t for o in again for t in o.token_ids] == [100, 101, 102, 103]
    assert again[0].cached_tokens == 2 * BLOCK_SIZE


def req(n_prompt: int = 5, max_new: int = 4, ignore_eos: bool = True) -> GenerationRequest:
    return GenerationRequest(tuple(range(10, 10 + n_prompt)), max_new, ignore_eos)


def run_until_idle(engine: InferenceEngine, on_step: Callable[[int], None] | None = None) -> list[StepOutput]:
    outputs: list[StepOutput] = []
    for i in range(200):
        if on_step:
            on_step(i)
        if not engine.num_active():
            return outputs
        outputs.extend(engine.step())
    raise AssertionError("engine never became idle")


def test_each_sequence_gets_exactly_its_own_budget(engine: InferenceEngine) -> None:
    ids = engine.admit([req(max_new=1), req(max_new=3), req(n_prompt=9, max_new=6)])
    outputs = run_until_idle(engine)
    for seq_id, budget in zip(ids, [1, 3, 6], strict=True):
        mine = [o for o in outputs if o.seq_id == seq_id]
        assert sum(len(o.token_ids) for o in mine) == budget
        assert [o.finish_reason for o in mine] == [None] * (len(mine) - 1) + ["length"]
    assert engine.num_active() == 0


def test_sequences_leave_independently(engine: InferenceEngine) -> None:
    short, long = engine.admit([req(max_new=2), req(max_new=8)])
    engine.step()
    second = engine.step()
    assert {o.seq_id: o.finish_reason for o in second} == {short: "length", long: None}
    assert engine.num_active() == 1


def test_newcomer_joins_mid_flight(engine: InferenceEngine) -> None:
    first = engine.admit([req(max_new=6)])[0]
    engine.step()
    engine.step()
    late = engine.admit([req(n_prompt=3, max_new=2)])[0]
    outputs = run_until_idle(engine)
    assert sum(len(o.token_ids) for o in outputs if o.seq_id == late) == 2
    assert sum(len(o.token_ids) for o in outputs if o.seq_id == first) == 4


@pytest.mark.parametrize(
    "bad",
    [
        GenerationRequest((), 4),
        GenerationRequest((1, 2), 0),
        GenerationRequest(tuple(range(60)), 5),  # 65 > max_model_len
    ],
    ids=["empty-prompt", "zero-budget", "over-context"],
)
def test_impossible_request_rejected_atomically(engine: InferenceEngine, bad: GenerationRequest) -> None:
    engine.admit([req()])
    with pytest.raises(ValueError):
        engine.admit([req(), bad])
    assert engine.num_active() == 1  # neither request of the failed admit got in
    assert len(run_until_idle(engine)) == 4


def test_capacity_is_enforced(engine: InferenceEngine) -> None:
    engine.admit([req() for _ in range(4)])
    assert not engine.can_admit(req())
    with pytest.raises(RuntimeError):
        engine.admit([req()])
    assert engine.num_active() == 4


def test_abort_frees_the_sequence(engine: InferenceEngine) -> None:
    keep, drop = engine.admit([req(max_new=5), req(max_new=5)])
    engine.step()
    engine.abort(drop)
    engine.abort(12345)  # unknown ids are ignored
    outputs = run_until_idle(engine)
    assert {o.seq_id for o in outputs} == {keep}


def test_reset_drops_everything(engine: InferenceEngine) -> None:
    engine.admit([req(), req()])
    engine.step()
    engine.reset()
    assert engine.num_active() == 0
    assert engine.step() == []
    engine.admit([req(max_new=2)])
    assert sum(len(o.token_ids) for o in run_until_idle(engine)) == 2
