"""A hybrid model's recurrent state per sequence (LFM2's short convolutions, ``engine/runtime/recurrent_state.py``),
on a tiny LFM2 GGUF written as llama.cpp's converter writes it and served from its blocks (the native path, default
flags): its streams are transformers' own, and the same whatever the load: alone or in a batch, its prompt cut into
any chunks, preempted, parked and resumed, in a slot another sequence used before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from engine_helpers import make_engine, reference, run_outputs, run_queued, run_staggered
from gguf import GGMLQuantizationType as T
from gguf_files import LFM2_LAYERS, tiny_model, write_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.core.config import BLOCK_SIZE
from engine.core.types import GenerationRequest
from engine.runtime.batch_engine import _cache_shape
from engine.runtime.kv_cache import BlockKVCache

#: The mix of ``test_architectures``: the convolutions' projections in blocks of 5 and 8 bits.
MIX = {"attn_q": T.Q5_0, "attn_k": T.Q5_0, "attn_v": T.Q8_0, "attn_output": T.Q5_1, "ffn_gate": T.Q4_0,
       "ffn_up": T.Q4_0, "ffn_down": T.Q4_1, "token_embd": T.Q5_0, "output": T.Q8_0, "in_proj": T.Q5_0,
       "out_proj": T.Q8_0, "attn_qkv": T.Q5_0, "attn_gate": T.Q8_0, "ssm_out": T.Q5_0, "ssm_in": T.Q8_0}  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory):
    """``files(arch, mix, dtype)``: the tiny model of ``arch`` (the file's reference) and the file as `make serve`
    loads it (activations in ``dtype``: `--dtype auto` takes bfloat16 on CPUs with BF16), made once each."""
    from engine.runtime import loader

    root = tmp_path_factory.mktemp("hybrid")
    made: dict[tuple[str, str], tuple] = {}
    loads: dict[tuple[str, str, str], tuple] = {}

    def get(arch: str, mix: str, dtype: str = "float32") -> tuple:
        path = root / f"{arch}-{mix}.gguf"
        if (arch, mix) not in made:
            made[arch, mix] = write_gguf(tiny_model(arch, vocab=49152), arch, path, loader._default_gguf(),
                                         MIX if mix == "mixed" else {})  # fmt: skip
        if (arch, mix, dtype) not in loads:
            with pytest.MonkeyPatch.context() as patch:
                patch.setenv("SMOLSERVE_CACHE_DIR", str(root / "cache"))
                loads[arch, mix, dtype] = made[arch, mix], loader.load(str(path), dtype, blocks=True)
        return loads[arch, mix, dtype]

    return get


@pytest.fixture(params=["lfm2", "qwen35", "qwen35moe", "granitehybrid"])
def hybrid(request: pytest.FixtureRequest, files):
    """``hybrid(mix)``: each hybrid family's tiny model and file (LFM2's short convolutions; Qwen3.5's linear
    attention: a convolution and a gated delta rule; Qwen3.5-MoE's, beside a mixture of experts; Granite 4.0-H's
    Mamba-2 layers: a convolution with a bias and a selective scan)."""
    return lambda mix: files(request.param, mix)


@pytest.fixture
def lfm2(files):
    return lambda mix: files("lfm2", mix)


def prompt(seed: int, length: int) -> tuple[int, ...]:
    return tuple((seed * 7919 + i * 104729) % 49000 + 100 for i in range(length))


def blocks_bytes(model, blocks: int) -> int:
    shape, layer_shapes = _cache_shape(model)
    return BlockKVCache.bytes_per_token(*shape, "auto", layer_shapes) * BLOCK_SIZE * blocks


def test_greedy_tokens_are_transformers_generate_s(hybrid) -> None:
    """The F32 file: each decoding step reads the state the step before left, as transformers' own cache does."""
    model, loaded = hybrid("F32")
    engine = make_engine(loaded.model, loaded.eos_token_ids, max_num_batched_tokens=16)
    requests = [GenerationRequest(prompt(i, 5 + 23 * i), 12, ignore_eos=True) for i in range(3)]
    got = run_staggered(engine, [(i, r) for i, r in enumerate(requests)])
    for index, request in enumerate(requests):
        assert got[index] == reference(model, request), index


@pytest.mark.parametrize("budget", [1, 5, 16, 64])
def test_a_prompt_cut_into_any_chunks_scores_to_the_same_bits(hybrid, budget: int) -> None:
    """A chunk's first rows read the inputs before it from the state, later ones from the chunk: the same values, the
    same sums. (Cut where the state's span straddles a chunk's start: budgets of 1 and 5 rows.)"""
    _, loaded = hybrid("mixed")
    request = GenerationRequest(prompt(3, 70), 6, ignore_eos=True, prompt_logprobs=1, logprobs=2)

    def run(budget: int) -> tuple:
        engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=budget)
        engine.admit([request])
        outputs = [out for _ in range(200) if engine.num_active() for out in engine.step()]
        return outputs[0].prompt_logprobs, [entry for out in outputs for entry in out.logprobs]

    assert run(budget) == run(512)


def test_a_slot_another_sequence_used_starts_from_nothing(hybrid) -> None:
    """One slot: the second request takes the state slot the first left; its stream is its stream alone."""
    _, loaded = hybrid("mixed")
    first, second = (GenerationRequest(prompt(s, 30), 8, ignore_eos=True, logprobs=1) for s in (5, 6))
    shared = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, capacity=1)
    after = run_outputs(shared, [(0, first)])[0], run_outputs(shared, [(0, second)])[0]
    alone = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, capacity=1)
    assert after[1] == run_outputs(alone, [(0, second)])[0]


def test_a_preempted_sequence_recomputes_its_state_exactly(hybrid) -> None:
    """A pool too small for three: the newest are preempted, free their blocks and recompute prompt and output."""
    _, loaded = hybrid("mixed")
    requests = [(0, GenerationRequest(prompt(10 + i, 40), 50, ignore_eos=True, logprobs=1)) for i in range(3)]
    tight = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_model_len=128,
                        kv_cache_bytes=blocks_bytes(loaded.model, 14), max_num_batched_tokens=32)  # fmt: skip
    roomy = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_model_len=128)
    got = run_outputs(tight, requests)
    assert tight.num_preemptions > 0
    assert got == run_outputs(roomy, requests)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(
        st.tuples(st.integers(0, 5), st.integers(1, 60), st.integers(1, 16), st.integers(0, 6), st.integers(0, 2)),
        min_size=1,
        max_size=7,
    )
)
def test_priorities_parking_preemption_and_chunks_never_change_a_stream(hybrid, requests: list[tuple]) -> None:
    """Requests of random prompts, lengths and priorities, queued and admitted as the scheduler does into three
    slots and a small pool, prompts cut into chunks of 13: more urgent ones park less urgent ones, the pool preempts;
    every stream equals a roomy run's, each alone in its steps' budget."""
    _, loaded = hybrid("mixed")
    arrivals = [(at, GenerationRequest(prompt(stem, 4 + length), new, ignore_eos=True, priority=priority))
                for stem, length, new, at, priority in requests]  # fmt: skip
    tight = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, capacity=3, max_model_len=128,
                        kv_cache_bytes=blocks_bytes(loaded.model, 12), max_num_batched_tokens=13)  # fmt: skip
    roomy = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_model_len=128)
    assert run_queued(tight, arrivals) == run_staggered(roomy, arrivals)
    assert tight.num_active() == 0


def test_the_engine_says_what_a_sequence_s_state_costs_and_what_is_off(lfm2) -> None:
    """Speculation asked for is off, with its reason; the state's bytes a sequence (its convolution layers' last two
    inputs, float32), the states kept for the prefix cache (an eighth of the KV cache's bytes), the KV cache's
    attention layers alone."""
    from engine.core.speculation import DraftBudget

    _, loaded = lfm2("mixed")
    drafts = DraftBudget("ngram", 256)
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, draft_rows=drafts)
    info = engine.runtime_info()
    convolutions = LFM2_LAYERS.count("conv")
    per_sequence = convolutions * 2 * 128 * 4
    assert info["recurrent_state"]["bytes_per_sequence"] == per_sequence
    assert info["recurrent_state"]["bytes"] == 8 * per_sequence
    assert info["recurrent_state"]["kept_at_block_ends"] == (1 << 28) // 8 // per_sequence
    assert info["prefix_caching"] is True
    assert info["speculative"] == "none" and "rolled back" in info["hybrid_limits"]["speculative"]
    assert engine.cache.num_layers == len(LFM2_LAYERS) - convolutions
    without = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, prefix_caching=False)
    assert without.runtime_info()["recurrent_state"]["kept_at_block_ends"] == 0


def test_a_qwen35_sequence_s_state_is_its_convolutions_and_its_matrices(files) -> None:
    """Qwen3.5: per linear-attention layer, the convolution's last three inputs (query, key and value channels) and
    each value head's key-by-value matrix in float32; the KV cache holds its one attention layer."""
    from gguf_files import QWEN35_LINEAR

    _, loaded = files("qwen35", "mixed")
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    state = engine.runtime_info()["recurrent_state"]
    heads, key, value = (QWEN35_LINEAR[f"linear_{name}"] for name in ("num_value_heads", "key_head_dim",
                                                                      "value_head_dim"))  # fmt: skip
    channels = 2 * QWEN35_LINEAR["linear_num_key_heads"] * key + heads * value
    assert state["kind"] == "gated delta rule" and state["layers"] == 3
    assert state["bytes_per_sequence"] == 3 * (3 * channels * 4 + heads * key * value * 4)
    assert engine.cache.num_layers == 1


def test_a_granite_hybrid_sequence_s_state_is_its_convolutions_and_its_scan_s_matrices(files) -> None:
    """Granite 4.0-H: per Mamba-2 layer, the convolution's last three inputs (``x``, ``B`` and ``C``'s channels) and
    each head's state-by-head-dim matrix in float32; the KV cache holds its one attention layer."""
    from gguf_files import GRANITE_HYBRID_LAYERS, GRANITE_MAMBA

    _, loaded = files("granitehybrid", "mixed")
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    state = engine.runtime_info()["recurrent_state"]
    heads, head, size = (GRANITE_MAMBA[f"mamba_{name}"] for name in ("n_heads", "d_head", "d_state"))
    channels = heads * head + 2 * GRANITE_MAMBA["mamba_n_groups"] * size
    layers = GRANITE_HYBRID_LAYERS.count("linear_attention")
    assert state["kind"] == "Mamba-2 scan" and state["layers"] == layers
    assert state["bytes_per_sequence"] == layers * (3 * channels * 4 + heads * size * head * 4)
    assert engine.cache.num_layers == len(GRANITE_HYBRID_LAYERS) - layers


def test_a_shared_prefix_resumes_from_the_state_kept_at_its_last_block(hybrid) -> None:
    """An agent's second turn: the first's prompt and answer, then more. Its prefix comes from the cache (whole
    blocks), its state from the one kept at the last of them; its stream is the one computed from nothing."""
    _, loaded = hybrid("mixed")
    first = GenerationRequest(prompt(8, 75), 10, ignore_eos=True)
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24)
    answer = run_outputs(engine, [(0, first)])[0]
    second = GenerationRequest(first.prompt_ids + tuple(e.token_id for e in answer) + prompt(9, 30), 12,
                               ignore_eos=True, logprobs=2)  # fmt: skip
    engine.admit([second])
    outputs = [out for _ in range(100) if engine.num_active() for out in engine.step()]
    assert outputs[0].cached_tokens == 80  # five whole blocks of the first's 85 positions
    fresh = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, prefix_caching=False)
    assert [entry for out in outputs for entry in out.logprobs] == run_outputs(fresh, [(0, second)])[0]


def test_a_restarted_engine_resumes_a_shared_prefix_from_the_disk_tier_exactly(
    hybrid, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The prefix cache's disk tier keeps a hybrid's state at each prompt's last block end (one a prompt, in a folder
    of its own; prompts of at least ``STATES_ON_DISK_FROM`` tokens, here 64) beside the KV blocks: an agent's second
    turn, sent to an engine started afresh on the same folder, reads the first turn's prompt's blocks and that state
    from disk and resumes there (a prompt in chunks of 24: the state at 64 was reached before the completing chunk);
    its stream is the one computed from nothing. A state another configuration wrote is never read (its folder is
    named by the configuration, as the blocks' are); a shorter prompt's state is not written."""
    from engine.runtime import batch_engine
    from engine.runtime.kv_disk import DiskSpec

    monkeypatch.setattr(batch_engine, "STATES_ON_DISK_FROM", 64)
    _, loaded = hybrid("mixed")
    spec = DiskSpec(tmp_path, 1 << 30, {})
    first = GenerationRequest(prompt(8, 75), 10, ignore_eos=True)
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24,
                         kv_disk=spec)  # fmt: skip
    answer = run_outputs(engine, [(0, first)])[0]
    engine.close()  # (the writers finish)
    second = GenerationRequest(first.prompt_ids + tuple(e.token_id for e in answer) + prompt(9, 30), 12,
                               ignore_eos=True, logprobs=2)  # fmt: skip
    restarted = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, kv_disk=spec)
    restarted.admit([second])
    outputs = [out for _ in range(100) if restarted.num_active() for out in restarted.step()]
    assert outputs[0].cached_tokens == 64  # the first turn's prompt's four whole blocks, its state at their end
    stats = restarted.disk_stats()
    assert stats is not None and stats["states"]["restored_blocks"] == 1 and stats["restored_blocks"] >= 4
    assert "hit_tokens" not in stats["states"]  # (the blocks' tier counts the tokens; a state is no tokens)
    fresh = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, prefix_caching=False)
    assert [entry for out in outputs for entry in out.logprobs] == run_outputs(fresh, [(0, second)])[0]
    other = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, kv_disk=spec,
                        kv_cache_dtype="int8")  # fmt: skip
    other.admit([second])
    first_out, *_ = [out for _ in range(100) if other.num_active() for out in other.step()]
    assert first_out.cached_tokens == 0
    for made in (restarted, other):
        made.close()
    monkeypatch.setattr(batch_engine, "STATES_ON_DISK_FROM", 80)  # the first prompt's last block end is 64: too short
    short = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, kv_disk=DiskSpec(tmp_path / "b",
                        1 << 30, {}))  # fmt: skip
    run_outputs(short, [(0, first)])
    short.close()
    stats = short.disk_stats()
    assert stats is not None and stats["states"]["written_blocks"] == 0 and stats["written_blocks"] >= 4


def test_a_prefix_whose_last_states_were_dropped_ends_at_the_last_kept_one(hybrid) -> None:
    """A prompt in chunks of 24 keeps the state at each chunk's last block end (16, 48, 64; not 80: the sequence ends
    in that step and its blocks' hashes with it); with room for one, 16 and 48 are dropped. A prompt sharing its
    first 50 tokens finds three cached blocks: with their states kept it resumes at 48, else it computes from the
    start; both exactly."""
    _, loaded = hybrid("mixed")
    again = GenerationRequest(prompt(4, 90)[:50] + prompt(5, 8), 6, ignore_eos=True, logprobs=1)
    fresh = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, prefix_caching=False)
    expected = run_outputs(fresh, [(0, again)])[0]
    for room, cached in ((1, 0), (8, 48)):
        engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks, max_num_batched_tokens=24)
        engine.states.max_checkpoints = room
        run_outputs(engine, [(0, GenerationRequest(prompt(4, 90), 1))])
        engine.admit([again])
        outputs = [out for _ in range(50) if engine.num_active() for out in engine.step()]
        assert outputs[0].cached_tokens == cached
        assert [entry for out in outputs for entry in out.logprobs] == expected


def test_served_with_default_flags_it_answers_and_says_what_a_sequence_costs(lfm2, tmp_path: Path) -> None:
    """As `make serve` builds it from the file (default flags: prefix caching, batch invariance and speculation
    asked for): the summary says the state's memory and what is off; a completion and a streamed one say the same."""
    from starlette.testclient import TestClient

    from app.server.app import create_app
    from app.server.state import ServerConfig, server_state
    from app.server.summary import startup_summary
    from engine import chooser
    from engine.core.config import EngineConfig
    from tests.app_helpers import LOCAL

    path = lfm2("mixed")[1].gguf
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(tmp_path))
        served = chooser.build(EngineConfig(model=str(path), max_batch_size=4))
    app = create_app(served, ServerConfig(served_model_name="lfm2"))
    summary = startup_summary(server_state(app), served.engine.runtime_info(), "http://127.0.0.1:9")
    # 3 layers' last 2 positions of 128 channels: 3 KiB in float32, 1.5 in bfloat16 (`--dtype auto` on BF16 CPUs)
    kib = 3 if "activations float32" in summary else 2
    state = f"recurrent state (short convolution, 3 layers): {kib} KiB a sequence, 0.0 MiB for 4; kept at up to"
    assert state in summary
    assert "speculative off: the recurrent layers' state is not rolled back past a draft" in summary
    assert f"every drafted position, {kib} KiB a sequence each" in summary  # what rolling back would cost
    body = {"model": "lfm2", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0}
    with TestClient(app, base_url=LOCAL) as client:
        whole = client.post("/v1/completions", json=body).json()
        streamed = client.post("/v1/completions", json={**body, "stream": True}).text
    assert whole["usage"]["completion_tokens"] == 8
    pieces = [json.loads(line[6:])["choices"][0]["text"] for line in streamed.splitlines()
              if line.startswith("data: {")]  # fmt: skip
    assert "".join(pieces) == whole["choices"][0]["text"]


def test_a_fresh_sequence_never_reads_what_its_slot_held(hybrid) -> None:
    """A slot's state is never read at a sequence's first position: filled with NaN beforehand, the stream is the
    same, to the bits of its logprobs."""
    _, loaded = hybrid("mixed")
    request = GenerationRequest(prompt(1, 20), 4, ignore_eos=True, logprobs=1)
    engine = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    engine.states.state.fill_(float("nan"))
    clean = make_engine(loaded.model, loaded.eos_token_ids, quantized=loaded.blocks)
    assert run_outputs(engine, [(0, request)]) == run_outputs(clean, [(0, request)])


@pytest.mark.parametrize("correct", [True, False], ids=["delta rule", "mamba-2 scan"])
def test_the_native_delta_rule_is_torch_s_to_rounding_and_the_same_bits_however_cut(correct: bool) -> None:
    """``csrc/delta_rule.cpp`` against ``delta_rule.step`` position by position (float32, 4 heads of 32 x 16, decays
    and betas over their ranges; ``correct`` False: Mamba-2's scan, Granite 4.0-H's): equal to rounding; and a
    sequence's positions in one call or cut in three give the same bits, its matrix the same too."""
    from engine.runtime import delta_rule, kernels

    ops = kernels.native_ops()
    if ops is None:
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(0)
    heads, keys, values, positions = 4, 32, 16, 40
    query, key = (delta_rule.l2norm(torch.randn(positions, heads, keys, generator=generator)) for _ in range(2))
    value = torch.randn(positions, heads, values, generator=generator)
    decay = -torch.rand(positions, heads, generator=generator) * 3
    beta = torch.rand(positions, heads, generator=generator)
    start = torch.randn(heads, keys, values, generator=generator) * 0.1
    state, reads = start[None].clone(), []
    for t in range(positions):
        state, read = delta_rule.step(state, query[t : t + 1], key[t : t + 1], value[t : t + 1], decay[t : t + 1],
                                      beta[t : t + 1], correct)  # fmt: skip
        reads.append(read)
    whole = start.clone()
    native = ops.delta_rule(whole, query, key, value, decay, beta, correct)
    torch.testing.assert_close(native, torch.cat(reads), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(whole, state[0], atol=1e-5, rtol=1e-5)
    cut, pieces = start.clone(), []
    for first, last in ((0, 1), (1, 17), (17, positions)):
        parts = (x[first:last].contiguous() for x in (query, key, value, decay, beta))
        pieces.append(ops.delta_rule(cut, *parts, correct))
    assert torch.equal(torch.cat(pieces), native) and torch.equal(cut, whole)
    if not correct:  # the scan's own form: S = exp(g) S + k (v beta)^T, read by q
        plain = start.clone()
        for t in range(positions):
            plain = plain * decay[t].exp()[:, None, None] + key[t][..., None] * (value[t] * beta[t][:, None])[:, None]
        torch.testing.assert_close(whole, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_short_convolution_is_torch_s_and_the_same_bits_however_cut(dtype: torch.dtype) -> None:
    """``csrc/short_conv.cpp`` against a plain causal convolution of a sequence's inputs (3 past inputs of a state,
    then 40 positions; 1,100 channels: more than a task's block): equal to rounding; one call or cut in three,
    beside another sequence or alone, the same bits and the same state after; a fresh sequence reads no state."""
    from engine.runtime import kernels

    ops = kernels.native_ops()
    if ops is None:
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(0)
    channels, keep, positions = 1100, 3, 40
    weight = torch.randn(channels, keep + 1, generator=generator).to(dtype).float()
    inputs = torch.randn(positions, channels, generator=generator).to(dtype)
    start = torch.randn(2, keep, channels, generator=generator).to(dtype)
    padded = torch.cat([start[1], inputs]).float()
    plain = sum(padded[k : k + positions] * weight[:, k] for k in range(keep + 1))
    state = start.clone()
    whole = ops.short_conv(state, inputs, weight, torch.tensor([[1, 0, 0, positions]]))
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(whole.float(), plain, **tolerance)
    assert torch.equal(state[1], inputs[-keep:]) and torch.equal(state[0], start[0])
    cut, pieces = start.clone(), []
    for first, last in ((0, 1), (1, 17), (17, positions)):  # beside another sequence in the middle piece
        rows = torch.cat([inputs[first:last], inputs[:5]]) if first == 1 else inputs[first:last]
        table = [[1, 0, 0, last - first]] + ([[0, 1, last - first, 5]] if first == 1 else [])
        pieces.append(ops.short_conv(cut, rows.contiguous(), weight, torch.tensor(table))[: last - first])
    assert torch.equal(torch.cat(pieces), whole) and torch.equal(cut[1], state[1])
    fresh = ops.short_conv(start.clone(), inputs, weight, torch.tensor([[1, 1, 0, positions]]))
    alone = ops.short_conv(torch.zeros_like(start), inputs, weight, torch.tensor([[1, 0, 0, positions]]))
    assert torch.equal(fresh, alone)


def test_torch_s_convolution_where_the_native_op_does_not_build_is_the_native_one_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the native kernels do not build, a step's convolution gathers each row's window in torch: the same
    outputs to rounding, the same states after it and kept at a block end, for a fresh sequence, a decoding one
    and a chunk that crosses a block end."""
    from engine.runtime import kernels, recurrent_state
    from engine.runtime.recurrent_state import RecurrentStates, Segment

    if kernels.native_ops() is None:
        pytest.skip("no native kernels here")
    segments = [Segment(3, 0, 0, 5), Segment(1, 7, 5, 1), Segment(0, 16, 6, 20)]
    generator = torch.Generator().manual_seed(0)
    inputs, weight = torch.randn(26, 96, generator=generator), torch.randn(96, 4, generator=generator)
    start = torch.randn(1, 8, 3, 96, generator=generator)
    results = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(recurrent_state.kernels, "native_ops", lambda: None)
        states = RecurrentStates(1, 8, 96, 4, torch.float32, torch.device("cpu"), 16, max_checkpoints=4)
        states.state.copy_(start)
        step = states.step(segments, 26)
        results.append((step.convolve(0, inputs, weight), states.state.clone(), step.states_at_boundaries()))
    (native_out, native_state, native_kept), (torch_out, torch_state, torch_kept) = results
    torch.testing.assert_close(torch_out, native_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch_state, native_state) and len(native_kept) == 1
    assert torch.equal(torch_kept[0], native_kept[0])


def test_a_hybrid_the_native_runner_does_not_serve_is_refused_not_run_without_its_state(files) -> None:
    """transformers' forward (the runner of other models) keeps no recurrent state between steps: a hybrid whose
    config the native runner leaves out (a RoPE scaling by length) is refused at start, naming the model type."""
    import copy

    from engine.runtime.model_runner import make_runner

    model = copy.deepcopy(files("lfm2", "F32")[0])
    model.config.rope_parameters = {**model.config.rope_parameters, "rope_type": "dynamic", "factor": 2.0}
    with pytest.raises(ValueError, match="lfm2 model's configuration is not served by the native runner"):
        make_runner(model, 64)


def test_a_model_that_keeps_state_between_steps_is_refused_by_the_transformers_path() -> None:
    """A HuggingFace Qwen3-Next checkpoint (its model type has no native row: its GGUF is served) or a Gemma 4 one
    whose last layers read earlier layers' KV would run through transformers' forward, which keeps neither between
    steps here: refused at start, not served wrong."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration, Qwen3NextConfig, Qwen3NextForCausalLM

    from engine.runtime.model_runner import make_runner

    small = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "num_attention_heads": 2,
             "num_key_value_heads": 1, "head_dim": 16}  # fmt: skip
    nexts = Qwen3NextConfig(**small, num_hidden_layers=4, linear_num_key_heads=1, linear_num_value_heads=1,
                            linear_key_head_dim=16, linear_value_head_dim=16, num_experts=2, num_experts_per_tok=1,
                            moe_intermediate_size=16, shared_expert_intermediate_size=16)  # fmt: skip
    text = {**small, "num_hidden_layers": 3, "num_kv_shared_layers": 1, "global_head_dim": 16,
            "hidden_size_per_layer_input": 0,
            "layer_types": ["sliding_attention", "full_attention", "full_attention"]}  # fmt: skip
    for model in (Qwen3NextForCausalLM(nexts), Gemma4ForConditionalGeneration(Gemma4Config(text_config=text))):
        with pytest.raises(ValueError, match="is not served by the native runner"):
            make_runner(model, 64)


@pytest.mark.parametrize("arch", ["lfm2", "qwen35", "qwen35moe", "granitehybrid"])
def test_a_hybrid_in_bfloat16_scores_a_prompt_as_in_float32_to_its_rounding(arch: str, files) -> None:
    """`--dtype auto` serves in bfloat16 on CPUs with BF16 (Zen 4, Sapphire Rapids): every op of a hybrid's layers
    takes it (Qwen3.5's gated delta rule was given its gates in bfloat16 and refused them: every step failed there).
    Measured, bfloat16 from float32 over 39 prompt tokens: mean 0.04 (lfm2), 0.16 (qwen35), 0.58 (qwen35moe, its
    router's choices moved too; transformers' own bfloat16 from its float32: 0.20); a wrong op moves whole units."""
    scores = {}
    for dtype in ("float32", "bfloat16"):
        _, loaded = files(arch, "mixed", dtype)
        assert loaded.model.dtype == getattr(torch, dtype)
        engine = make_engine(loaded.model, loaded.eos_token_ids, max_num_batched_tokens=16, quantized=loaded.blocks)
        engine.admit([GenerationRequest(prompt(1, 40), 1, ignore_eos=True, prompt_logprobs=0)])
        found: list[float] = []
        while engine.num_active():
            for out in engine.step():
                found += [entry.logprob for entry in out.prompt_logprobs or [] if entry is not None]
        scores[dtype] = torch.tensor(found)
    assert len(scores["float32"]) == len(scores["bfloat16"]) == 39
    gaps = (scores["float32"] - scores["bfloat16"]).abs()
    assert gaps.mean() < 1.0 and gaps.max() < 4.0, (gaps.mean(), gaps.max())


def test_an_evicted_checkpoint_s_matrices_are_written_again_never_a_kept_one_s() -> None:
    """Checkpoints' matrices (54.7 MiB a sequence on Granite 4.0-H-1B) are written into buffers that evicted
    checkpoints held, not new ones whose pages fault in: a buffer comes back only once nothing resumes from it."""
    from engine.runtime.recurrent_state import RecurrentStates

    states = RecurrentStates(2, 2, 4, 3, torch.float32, torch.device("cpu"), BLOCK_SIZE, max_checkpoints=1,
                             matrix=(1, 2, 2))  # fmt: skip
    first = states.matrix_buffer().fill_(1.0)
    states.keep(b"first", torch.zeros(2, 2, 4), first)
    second = states.matrix_buffer()
    assert second is not first  # still kept
    states.keep(b"second", torch.zeros(2, 2, 4), second.fill_(2.0))  # room for one: the first is evicted
    third = states.matrix_buffer()
    assert third is first
    third.fill_(3.0)
    assert not states.resume(0, b"first")
    assert states.resume(1, b"second") and torch.equal(states.matrices[:, 1], torch.full((2, 1, 2, 2), 2.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_mamba_steps_are_torch_s_to_rounding_and_a_row_s_bits_whatever_its_batch(dtype) -> None:
    """``csrc/recurrent_steps.cpp``'s steps each side of Granite 4.0-H's scan (4 heads of 24 in 2 groups of B and C
    of 20; widths that fill no whole vector) against torch's ops as the runner calls them where the native ops do not
    build: equal to rounding; and a row's results the same bits alone, among 37 others or at another place."""
    from engine.runtime import kernels

    ops = kernels.native_ops()
    if ops is None:
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(0)
    heads, head_dim, groups, size, rows, eps = 4, 24, 2, 20, 37, 1e-5
    inner, shared = heads * head_dim, groups * size
    xbc = (torch.randn(rows, inner + 2 * shared, generator=generator) * 4).to(dtype)
    projected = (torch.randn(rows, inner + heads, generator=generator) * 3).to(dtype)  # z beside dt: strided views
    z, dt = projected.split([inner, heads], dim=-1)
    bias = torch.randn(inner + 2 * shared, generator=generator).to(dtype)
    dt_bias, decay, skip = (torch.randn(heads, generator=generator) for _ in range(3))
    norm, read = torch.randn(inner, generator=generator), torch.randn(rows, heads, head_dim, generator=generator)
    x, b, c, step, decay_step = ops.mamba_inputs(xbc, bias, dt, dt_bias, decay, heads, head_dim, groups, size)
    y = ops.mamba_output(read, x, skip, z, norm, groups, eps)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    act = F.silu(xbc + bias).float()
    torch.testing.assert_close(x, act[:, :inner].reshape(rows, heads, head_dim), **tolerance)
    for got, part in ((b, act[:, inner : inner + shared]), (c, act[:, inner + shared :])):
        torch.testing.assert_close(got, part.reshape(rows, groups, 1, size).expand(-1, -1, 2, -1).reshape(got.shape),
                                   **tolerance)  # fmt: skip
    torch.testing.assert_close(step, F.softplus(dt.float() + dt_bias), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(decay_step, step * decay)
    gated = ((read + x * skip[:, None]).reshape(rows, inner) * F.silu(z.float())).reshape(rows, groups, -1)
    plain = F.rms_norm(gated, (inner // groups,), eps=eps).reshape(rows, inner) * norm
    torch.testing.assert_close(y.float(), plain.to(dtype).float(), **tolerance)
    for row in (0, 17, 36):  # alone (a fresh tensor, at another address), and in the middle of others
        alone_in = ops.mamba_inputs(xbc[row : row + 1].clone(), bias, dt[row : row + 1].clone(), dt_bias, decay, heads,
                                    head_dim, groups, size)  # fmt: skip
        batched = (x, b, c, step, decay_step)
        assert all(torch.equal(one[0], many[row]) for one, many in zip(alone_in, batched, strict=True))
        alone = ops.mamba_output(read[row : row + 1].clone(), x[row : row + 1].clone(), skip,
                                 z[row : row + 1].clone(), norm, groups, eps)  # fmt: skip
        assert torch.equal(alone[0], y[row])
    without = ops.mamba_inputs(xbc, None, dt, dt_bias, decay, heads, head_dim, groups, size)[0]
    torch.testing.assert_close(without, F.silu(xbc).float()[:, :inner].reshape(rows, heads, head_dim), **tolerance)


@pytest.mark.parametrize("tiled", [False, True], ids=["grouped", "tiled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_native_delta_net_steps_are_torch_s_to_rounding_and_a_row_s_bits_whatever_its_batch(dtype, tiled) -> None:
    """``csrc/recurrent_steps.cpp``'s steps each side of Qwen3.5's gated delta rule (2 key heads of 24 serving 6
    value heads of 20, grouped or tiled) against torch's ops as the runner calls them where the native ops do not
    build: equal to rounding; and a row's results the same bits alone, among 37 others or at another place."""
    from engine.runtime import delta_rule, kernels

    ops = kernels.native_ops()
    if ops is None:
        pytest.skip("no native kernels here")
    generator = torch.Generator().manual_seed(0)
    key_heads, value_heads, key_dim, value_dim, rows, eps = 2, 6, 24, 20, 37, 1e-6
    keys, values = key_heads * key_dim, value_heads * value_dim
    mixed = (torch.randn(rows, 2 * keys + values, generator=generator) * 4).to(dtype)
    projected = (torch.randn(rows, values + 2 * value_heads, generator=generator) * 3).to(dtype)  # strided views
    z, gates = projected.split([values, 2 * value_heads], dim=-1)
    dt_bias, decay = torch.randn(value_heads, generator=generator), -torch.rand(value_heads, generator=generator)
    norm, read = torch.randn(value_dim, generator=generator).to(dtype), torch.randn(rows, value_heads, value_dim)
    native = ops.delta_inputs(mixed, gates, dt_bias, decay, key_heads, value_heads, key_dim, value_dim, tiled)
    out = ops.delta_output(read, z, norm, eps)
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.02}
    q, k, v = F.silu(mixed).float().split([keys, keys, values], dim=-1)
    q, k = (delta_rule.l2norm(x.reshape(rows, key_heads, -1)) for x in (q, k))
    b, a = gates.float().chunk(2, dim=-1)
    plain = (*delta_rule.prepare(q, k, value_heads, tiled), v.reshape(rows, value_heads, -1),
             decay * F.softplus(a + dt_bias), torch.sigmoid(b))  # fmt: skip
    for got, want in zip(native, plain, strict=True):
        torch.testing.assert_close(got, want, **tolerance)
    normed = norm * F.rms_norm(read.to(dtype).float(), (value_dim,), eps=eps).to(dtype)
    gated = (normed * F.silu(z.float()).reshape(rows, value_heads, -1)).reshape(rows, -1)
    torch.testing.assert_close(out.float(), gated.to(dtype).float(), **tolerance)
    for row in (0, 17, 36):  # alone (a fresh tensor, at another address), and in the middle of others
        alone = ops.delta_inputs(mixed[row : row + 1].clone(), gates[row : row + 1].clone(), dt_bias, decay, key_heads,
                                 value_heads, key_dim, value_dim, tiled)  # fmt: skip
        assert all(torch.equal(one[0], many[row]) for one, many in zip(alone, native, strict=True))
        alone_out = ops.delta_output(read[row : row + 1].clone(), z[row : row + 1].clone(), norm, eps)
        assert torch.equal(alone_out[0], out[row])
