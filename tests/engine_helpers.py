"""Helpers the engine tests share: an engine with test-sized limits, `generate` as the reference, and a driver
that admits requests at given steps."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from engine.core.types import GenerationRequest, TokenLogprob
from engine.runtime.batch_engine import HFEngine


def make_engine(model: PreTrainedModel, eos: frozenset[int], **overrides: int | str) -> HFEngine:
    options = {"capacity": 8, "max_model_len": 512, "kv_cache_bytes": 1 << 28, "max_num_batched_tokens": 512}
    options.update(overrides)
    return HFEngine(model, eos_token_ids=eos, **options)


def reference(model: PreTrainedModel, request: GenerationRequest) -> list[int]:
    """What plain `generate` produces for this prompt alone, greedy."""
    prompt = torch.tensor([request.prompt_ids])
    with torch.inference_mode():
        out = model.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=request.max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            # ignore_eos means: emit EOS like any token, but do not stop on it.
            **({"eos_token_id": []} if request.ignore_eos else {}),
        )
    return out[0, len(request.prompt_ids) :].tolist()


def run_staggered(engine: HFEngine, arrivals: list[tuple[int, GenerationRequest]]) -> dict[int, list[int]]:
    """Admit each request at its step number; return each request's tokens, by its index in `arrivals`."""
    return {index: [entry.token_id for entry in out] for index, out in run_outputs(engine, arrivals).items()}


def run_outputs(engine: HFEngine, arrivals: list[tuple[int, GenerationRequest]]) -> dict[int, list[TokenLogprob]]:
    """Admit each request at its step number and step until all are done; return what each produced, by its
    index in `arrivals`: a TokenLogprob per token (logprob 0.0 and no alternatives when none was asked for)."""
    produced: dict[int, list[TokenLogprob]] = {}
    seq_to_index: dict[int, int] = {}
    step = 0
    while len(produced) < len(arrivals) or engine.num_active():
        for index, (at, request) in enumerate(arrivals):
            if at == step:
                seq_to_index[engine.admit([request])[0]] = index
                produced[index] = []
        for out in engine.step():
            entries = out.logprobs or [TokenLogprob(token, 0.0) for token in out.token_ids]
            produced[seq_to_index[out.seq_id]].extend(entries)
        step += 1
        assert step < 20_000, "the engine made no progress"
    return produced


def run_queued(engine: HFEngine, arrivals: list[tuple[int, GenerationRequest]]) -> dict[int, list[int]]:
    """As the scheduler admits: each request joins a waiting queue at its step (by ``priority``, then arrival),
    and the head is admitted while ``make_room`` finds it room (parking less urgent sequences) or the engine is
    idle; return each request's tokens, by its index in `arrivals`."""
    produced: dict[int, list[int]] = {index: [] for index in range(len(arrivals))}
    waiting: list[int] = []
    seq_to_index: dict[int, int] = {}
    step = 0
    while step <= max(at for at, _ in arrivals) or waiting or engine.num_active():
        waiting += [index for index, (at, _) in enumerate(arrivals) if at == step]
        waiting.sort(key=lambda index: (arrivals[index][1].priority, index))
        while waiting and (engine.make_room(arrivals[waiting[0]][1]) or not engine.num_active()):
            index = waiting.pop(0)
            seq_to_index[engine.admit([arrivals[index][1]])[0]] = index
        for out in engine.step():
            produced[seq_to_index[out.seq_id]] += out.token_ids
        step += 1
        assert step < 20_000, "the engine made no progress"
    return produced


def prompt_ids(seed: int, length: int) -> tuple[int, ...]:
    """A deterministic prompt of ``length`` ids in a tiny model's vocabulary (8..297, never its EOS 7)."""
    return tuple((seed * 31 + i * 17) % 290 + 8 for i in range(length))
