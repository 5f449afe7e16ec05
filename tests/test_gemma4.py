"""Gemma 4 (dense) on the native path, from a tiny GGUF written as llama.cpp's converter writes it
(``tests/gguf_files.py``: three local layers and a global one, then a local and a global one reading the KV of the
last layer of their kind before them; the global heads twice as wide with one KV head, their keys as their values;
per-layer inputs; a soft-capped output): its tokens are transformers' own, its KV cache holds only the layers that
write one, each kind of layer in its own shape, and its streams are the same whatever the load (chunks, batches,
parking, preemption, prefixes from the cache or from disk)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, reference, run_outputs, run_queued, run_staggered
from gguf import GGMLQuantizationType as T
from gguf_files import GEMMA4_LAYERS, GEMMA_WINDOW, tiny_model, write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import BLOCK_SIZE
from engine.core.types import GenerationRequest, SamplingParams
from engine.runtime.batch_engine import _cache_shape
from engine.runtime.kv_cache import BlockKVCache
from engine.runtime.kv_disk import DiskSpec

#: Its matrices in blocks of 5 and 8 bits, its per-layer inputs' table and projections among them.
MIX = {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q5_1, "ffn_gate": T.Q4_0,
       "ffn_up": T.Q4_0, "ffn_down": T.Q4_1, "token_embd": T.Q5_0, "per_layer_token_embd": T.Q5_0,
       "per_layer_model_proj": T.Q8_0, "inp_gate": T.Q8_0, "proj": T.Q5_0}  # fmt: skip


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory):
    """``gemma4(mix)``: the tiny model (the file's reference) and its file as `make serve` loads it, made once each."""
    from engine.runtime import loader

    root = tmp_path_factory.mktemp("gemma4")
    made: dict[str, object] = {}
    loads: dict[tuple[str, str], tuple] = {}

    def get(mix: str, dtype: str = "float32") -> tuple:
        path = root / f"gemma4-{mix}.gguf"
        if mix not in made:
            made[mix] = write_gguf(tiny_model("gemma4", vocab=49152), "gemma4", path, loader._default_gguf(),
                                   MIX if mix == "mixed" else {})  # fmt: skip
        if (mix, dtype) not in loads:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("SMOLSERVE_CACHE_DIR", str(root / "cache"))
                loads[mix, dtype] = made[mix], loader.load(str(path), dtype, blocks=True)
        return loads[mix, dtype]

    return get


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 104729) % 49000 + 100 for i in range(length))


def blocks_bytes(model, blocks: int) -> int:
    shape, layer_shapes = _cache_shape(model)
    return BlockKVCache.bytes_per_token(*shape, "auto", layer_shapes) * BLOCK_SIZE * blocks


def test_greedy_tokens_are_transformers_generate_s_past_the_window(gemma4) -> None:
    """The F32 file: prompts shorter and longer than the local layers' window, decoded past it: the KV-sharing
    layers read what the layers before them wrote, each with its kind's window and rotation."""
    model, loaded = gemma4("F32")
    engine = make_engine(loaded.model, loaded.eos_token_ids, max_num_batched_tokens=16)
    requests = [GenerationRequest(prompt(i, 3 + 19 * i), 14, ignore_eos=True) for i in range(3)]
    assert requests[0].max_new_tokens + len(requests[0].prompt_ids) > GEMMA_WINDOW
    got = run_staggered(engine, [(i, r) for i, r in enumerate(requests)])
    for index, request in enumerate(requests):
        assert got[index] == reference(model, request), index


def test_the_cache_holds_the_layers_that_write_one_each_kind_in_its_shape(gemma4) -> None:
    """Four of the six layers write KV (the last two read theirs): the local ones two heads of 32, the global ones
    one of 64; a position costs what those hold, and the start-up summary says so."""
    _, loaded = gemma4("mixed")
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    writers = len(GEMMA4_LAYERS) - loaded.model.config.num_kv_shared_layers
    assert engine.cache.layer_shapes == [(2, 32) if kind == "sliding_attention" else (1, 64)
                                         for kind in GEMMA4_LAYERS[:writers]]  # fmt: skip
    assert [group[0].shape[:3] for group in engine.cache.groups] == [(3, 2, 2), (1, 2, 1)]
    per_token = (3 * 2 * 2 * 32 + 1 * 2 * 1 * 64) * 4  # float32 keys and values
    facts = engine._facts["kv_cache"]
    assert facts["bytes"] == facts["tokens"] * per_token


@pytest.mark.parametrize("scored", [True, False], ids=["prompt scored", "prompt not scored"])
@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_a_prompt_cut_into_any_chunks_scores_to_the_same_bits(gemma4, budget: int, scored: bool) -> None:
    """A prompt's chunks that go on compute no row past the last layer that writes KV (none is sampled): the
    same tokens and log-probabilities however the prompt is cut, its own scored or not."""
    _, loaded = gemma4("mixed")
    request = GenerationRequest(prompt(3, 70), 6, ignore_eos=True, prompt_logprobs=1 if scored else None, logprobs=2)

    def run(budget: int) -> tuple:
        engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=budget)
        engine.admit([request])
        outputs = [out for _ in range(200) if engine.num_active() for out in engine.step()]
        return outputs[0].prompt_logprobs, [entry for out in outputs for entry in out.logprobs]

    assert run(budget) == run(512)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 60), st.integers(1, 16), st.integers(0, 6), st.integers(0, 2)),
        min_size=1,
        max_size=6,
    )
)
def test_priorities_parking_preemption_and_chunks_never_change_a_stream(gemma4, requests: list[tuple]) -> None:
    """Random prompts, lengths and priorities into three slots and a small pool, prompts cut into chunks of 13:
    every stream equals a roomy run's."""
    _, loaded = gemma4("mixed")
    arrivals = [(at, GenerationRequest(prompt(stem, 4 + length), new, ignore_eos=True, priority=priority))
                for stem, length, new, at, priority in requests]  # fmt: skip
    tight = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, capacity=3, max_model_len=128,
                        kv_cache_bytes=blocks_bytes(loaded.model, 12), max_num_batched_tokens=13)  # fmt: skip
    roomy = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_model_len=128)
    assert run_queued(tight, arrivals) == run_staggered(roomy, arrivals)


def test_a_shared_prefix_from_the_cache_or_from_disk_gives_the_stream_computed_from_nothing(
    gemma4, tmp_path: Path
) -> None:
    """An agent's second turn finds the first's blocks in memory; asked again after a restart, its own on disk (each
    kind of layer's K/V in a block's bytes): the same tokens and log-probabilities as with no cache."""
    _, loaded = gemma4("mixed")
    first = GenerationRequest(prompt(8, 75), 10, ignore_eos=True)
    second = GenerationRequest(prompt(8, 75) + prompt(9, 30), 12, ignore_eos=True, logprobs=2)
    fresh = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, prefix_caching=False)
    expected = run_outputs(fresh, [(0, second)])[0]
    spec = DiskSpec(tmp_path, 1 << 30, {"model": "tiny-gemma4"})
    for turn in range(2):  # the second: a new engine over the first's disk tier
        engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, kv_disk=spec)
        if turn == 0:
            run_outputs(engine, [(0, first)])
        engine.admit([second])
        outputs = [out for _ in range(100) if engine.num_active() for out in engine.step()]
        # in memory: the first's 75 positions (its last block's part copied); after the restart, from disk: its own
        # six whole blocks, which the first engine wrote there
        assert outputs[0].cached_tokens == (75 if turn == 0 else 96), turn
        assert [entry for out in outputs for entry in out.logprobs] == expected
        if engine.disk is not None:
            engine.disk.flush()


def test_in_bfloat16_it_scores_a_prompt_as_in_float32_to_its_rounding(gemma4) -> None:
    """`--dtype auto` serves in bfloat16 on CPUs with BF16: every op of its layers takes it (the native element-wise
    ops where they build), its logprobs float32's to bfloat16's rounding; a wrong op moves whole units."""
    scores = {}
    for dtype in ("float32", "bfloat16"):
        _, loaded = gemma4("mixed", dtype)
        assert loaded.model.dtype == getattr(torch, dtype)
        engine = make_engine(loaded.model, loaded.eos_token_ids, max_num_batched_tokens=16, quantized=loaded.blocks)
        engine.admit([GenerationRequest(prompt(1, 40), 1, ignore_eos=True, prompt_logprobs=0)])
        outputs = [out for _ in range(20) if engine.num_active() for out in engine.step()]
        scores[dtype] = torch.tensor([entry.logprob for entry in outputs[0].prompt_logprobs[1:]])
    gaps = (scores["float32"] - scores["bfloat16"]).abs()
    assert len(gaps) == 39 and gaps.mean() < 0.5 and gaps.max() < 2.0, (gaps.mean(), gaps.max())


def test_its_turn_ends_at_the_end_of_turn_and_at_a_tool_response(tmp_path: Path) -> None:
    """As llama.cpp ends a Gemma 4 generation: at the file's EOS, at ``<turn|>`` and at ``<|tool_response>`` (which
    follows its calls), where the vocabulary has them."""
    from engine.runtime import loader

    renamed = {1: "<bos>", 2: "<eos>", 3: "<turn|>", 4: "<|tool_response>"}
    path = tmp_path / "gemma4-tokens.gguf"
    write_gguf(tiny_model("gemma4", vocab=49152), "gemma4", path, loader._default_gguf(), {}, renamed=renamed)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(tmp_path / "cache"))
        loaded = loader.load(str(path), "float32", blocks=True)
    assert {2, 3, 4} <= loaded.eos_token_ids
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    bias = GenerationRequest(prompt(1, 12), 20, sampling=SamplingParams(logit_bias=((3, 100.0),)))
    assert run_staggered(engine, [(0, bias)])[0] == [3]  # the end of turn ends it


def test_its_mixture_of_experts_size_is_refused_by_name() -> None:
    """Gemma 4's 26B-A4B (a mixture beside each MLP, its router's own scales) is not served: refused at start, naming
    what is, before any tensor is read."""
    from types import SimpleNamespace

    from engine.core.architectures import NotServedNatively
    from engine.runtime.gguf_config import _gemma4

    reader = SimpleNamespace(keys={"general.architecture": "gemma4", "gemma4.expert_count": 128}, tensors=[])
    with pytest.raises(NotServedNatively, match="26B-A4B"):
        _gemma4(reader, {"rope_theta": 1e6}, {"num_hidden_layers": 30, "layer_types": []})  # type: ignore[arg-type]
