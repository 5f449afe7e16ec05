"""The engine seam's contract, run against every implementation: the fake and the real HF engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from engine.core.fake_engine import FakeEngine
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


@pytest.fixture(params=["fake", "hf"])
def engine(request: pytest.FixtureRequest, tiny_llama_dir: str) -> InferenceEngine:
    return _fake() if request.param == "fake" else _hf(tiny_llama_dir)


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
