"""HFEngine: greedy outputs token-identical to `generate`, however sequences share, join and leave the batch."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest
import torch
from engine_helpers import make_engine, prompt_ids, reference, run_staggered
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine import chooser
from engine.core.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.core.tokenizer import HFTokenizer
from engine.core.types import GenerationRequest
from engine.runtime import kernels
from engine.runtime.batch_engine import HFEngine
from engine.runtime.kv_cache import BlockKVCache, StepBatch


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def tiny_pair(request: pytest.FixtureRequest) -> tuple[PreTrainedModel, PreTrainedModel]:
    """The engine's copy of a tiny model and an untouched copy for `generate`. llama runs through the lean
    LlamaRunner, gpt2 through transformers' own forward (HFRunner)."""
    path = request.getfixturevalue(f"tiny_{request.param}_dir")
    return AutoModelForCausalLM.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)


@pytest.mark.parametrize("attention", ["native", "torch", "int8"])
@pytest.mark.parametrize("chunk_budget", [512, 24], ids=["whole-prompts", "chunked-prefill"])
def test_tiny_model_parity_with_staggered_arrivals(
    tiny_pair, chunk_budget: int, attention: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode attention runs in the native kernel, or in torch's attention where it cannot be built, or over
    the 8-bit cache (whose rounding is too small to move these tiny models' greedy choices)."""
    if attention == "torch":
        monkeypatch.setattr(kernels, "decode_attention", lambda: None)
    else:
        assert kernels.decode_attention() is not None
    model, ref_model = tiny_pair
    kv_cache_dtype = "int8" if attention == "int8" else "auto"
    engine = make_engine(model, frozenset({7}), max_num_batched_tokens=chunk_budget, kv_cache_dtype=kv_cache_dtype)
    assert engine.cache.quantized == (attention == "int8")
    arrivals = [
        (0, GenerationRequest(prompt_ids(1, 5), 20, ignore_eos=True)),
        (0, GenerationRequest(prompt_ids(2, 70), 9, ignore_eos=True)),  # spans several chunks at budget 24
        (2, GenerationRequest(prompt_ids(3, 1), 15, ignore_eos=True)),
        (3, GenerationRequest(prompt_ids(4, 33), 1, ignore_eos=True)),
        (3, GenerationRequest(prompt_ids(5, 120), 12, ignore_eos=True)),
        (7, GenerationRequest(prompt_ids(6, 9), 30, ignore_eos=True)),
        (8, GenerationRequest(prompt_ids(7, 13), 25)),  # may stop early on EOS, like generate
    ]
    got = run_staggered(engine, arrivals)
    for index, (_, request) in enumerate(arrivals):
        assert got[index] == reference(ref_model, request), f"request {index}"
    stats = engine.memory_stats()
    assert stats.blocks_in_use == 0 and stats.blocks_cached + stats.blocks_free == stats.num_blocks


@pytest.mark.real_model
def test_real_model_greedy_parity_through_the_scheduler(real_model) -> None:
    """12 prompts of different lengths and budgets, submitted together: they join and leave at different
    steps, and each output is token-identical to `generate` on that prompt alone."""
    tokenizer = HFTokenizer(real_model.tokenizer, real_model.eos_token_ids)
    texts = [
        "The capital of France is",
        "Once upon a time",
        "def fibonacci(n):",
        "Hi",
        "List three colors:",
        "In 1969, astronauts",
        "The quick brown fox jumps over the lazy dog. " * 6,
        "Translate to French: cheese",
        "import numpy as np\nx = np.",
        "Water boils at",
        "My favourite book is",
        "Q: What is 2 + 2?\nA:",
    ]
    requests = [GenerationRequest(tuple(tokenizer.encode(t)), 4 + 3 * i) for i, t in enumerate(texts)]
    # A small step budget so the long prompt's prefill is chunked between other sequences' decode steps.
    engine = make_engine(real_model.model, real_model.eos_token_ids, max_num_batched_tokens=24, capacity=16)

    async def run_all() -> list[list[int]]:
        scheduler = Scheduler(engine, tokenizer)
        await scheduler.start()
        try:
            streams = [scheduler.submit(r) for r in requests]

            async def collect(stream) -> list[int]:
                return [t async for d in stream.deltas() for t in d.token_ids]

            return await asyncio.gather(*(collect(s) for s in streams))
        finally:
            await scheduler.stop()

    got = asyncio.run(run_all())
    ref_model = AutoModelForCausalLM.from_pretrained(real_model.model.name_or_path)
    for text, request, tokens in zip(texts, requests, got, strict=True):
        assert tokens == reference(ref_model, request), text


def test_served_engine_is_built_and_stepped_on_one_thread() -> None:
    """A second thread entering torch's OpenMP halved step speed, so the server keeps all torch work on the
    thread that loaded the model: the scheduler steps the engine there."""
    served = chooser.build(EngineConfig(max_batch_size=2))
    assert served.engine_thread is not None
    build_thread = served.engine_thread.submit(threading.get_ident).result()
    stepped_on: set[int] = set()
    step = served.engine.step

    def recording_step() -> list:
        stepped_on.add(threading.get_ident())
        return step()

    served.engine.step = recording_step

    async def generate() -> None:
        scheduler = Scheduler(served.engine, served.tokenizer, engine_thread=served.engine_thread)
        await scheduler.start()
        stream = scheduler.submit(GenerationRequest((1, 2, 3), 4, ignore_eos=True))
        assert sum([len(delta.token_ids) async for delta in stream.deltas()]) == 4
        await scheduler.stop()

    asyncio.run(generate())
    assert stepped_on == {build_thread}
    served.engine_thread.submit(lambda: None).result()  # the scheduler left the shared thread running
    served.engine_thread.shutdown()


def test_int8_cache_attends_over_what_each_block_holds() -> None:
    """What a row of the 8-bit cache attends over is what was written at its sequence's physical positions,
    blocks scattered over the pool, and a block copied into another (copy-on-diverge) carries it all."""
    torch.manual_seed(0)
    layers, heads, groups, dim = 2, 2, 3, 16
    cache = BlockKVCache(layers, heads, dim, torch.float32, torch.device("cpu"), num_blocks=8, kv_cache_dtype="int8")
    assert cache.quantized and BlockKVCache.bytes_per_token(layers, heads, dim, torch.float32, "int8") == (
        layers * 2 * heads * (dim + 4)
    )
    blocks = [5, 2]  # a sequence of 20 positions in blocks 5 and 2
    slots = torch.tensor([blocks[p // 16] * 16 + p % 16 for p in range(20)])
    stored = torch.randn(layers, 2, 20, heads, dim)
    for layer in range(layers):
        cache.write(layer, slots, stored[layer, 0], stored[layer, 1])
    cache.copy_block(5, 7)  # a sequence sharing the first block takes a copy of it
    query = torch.randn(2, heads, groups, dim)
    tables = torch.tensor([[5, 2], [7, 2]], dtype=torch.int32)
    batch = StepBatch(cache, 2, slots[:2], tables, torch.tensor([20, 16]))
    for layer in range(layers):
        got = cache.attend(layer, query, batch, dim**-0.5)
        keys, values = stored[layer, 0].transpose(0, 1), stored[layer, 1].transpose(0, 1)  # [heads, positions, dim]
        for row, length in enumerate((20, 16)):
            want = torch.nn.functional.scaled_dot_product_attention(
                query[row : row + 1], keys[None, :, :length], values[None, :, :length]
            )
            torch.testing.assert_close(got[row : row + 1], want, atol=6e-2, rtol=6e-2)


def test_int8_cache_refuses_a_head_size_its_kernels_do_not_take() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        BlockKVCache(2, 1, 6, torch.float32, torch.device("cpu"), num_blocks=4, kv_cache_dtype="int8")


def complete_on(served: chooser.ServedModel, text: str) -> str:
    """Eight greedy tokens after ``text`` through a scheduler on the served engine's own thread; then the thread
    is shut down."""
    assert served.engine_thread is not None
    prompt = tuple(served.tokenizer.encode(text))

    async def generate() -> str:
        scheduler = Scheduler(served.engine, served.tokenizer, engine_thread=served.engine_thread)
        await scheduler.start()
        stream = scheduler.submit(GenerationRequest(prompt, 8))
        completion = "".join([delta.text async for delta in stream.deltas()])
        await scheduler.stop()
        return completion

    try:
        return asyncio.run(generate())
    finally:
        served.engine_thread.shutdown()


@pytest.mark.real_model
def test_real_model_serves_from_an_int8_cache() -> None:
    served = chooser.build(EngineConfig(max_batch_size=2, kv_cache_dtype="int8"))
    assert isinstance(served.engine, HFEngine) and served.engine.cache.quantized
    assert served.engine_thread is not None
    assert "Paris" in complete_on(served, "The capital of France is")


def _mapping_field(address: int, name: str) -> list[str]:
    """A field of the smaps entry of this process's mapping that holds ``address`` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == f"{name}:":
            return line.split()[1:]
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc")
def test_the_pool_costs_what_is_written_asks_for_huge_pages_and_gives_pages_back() -> None:
    """The pool is sized for the worst case but the OS backs only the pages written; handed back, they read as
    zeros. Huge pages are asked for (the decode kernels ran 10-20% faster from them)."""
    cache = BlockKVCache(2, 3, 64, torch.bfloat16, torch.device("cpu"), num_blocks=2048)  # 96 MiB of K/V
    kv = cache.kv
    assert kv.shape == (2, 2, 3, 2048 * 16, 64) and kv.is_contiguous() and not kv[:, :, :, :64].any()
    assert "hg" in _mapping_field(kv.data_ptr(), "VmFlags")  # madvise(MADV_HUGEPAGE) reached the kernel
    kv[:, :, :, :16] = 1.0  # one block written
    assert int(_mapping_field(kv.data_ptr(), "Rss")[0]) <= 12 * 2048  # kB: a few (huge) pages, not 96 MiB
    cache.release_memory()
    assert int(_mapping_field(kv.data_ptr(), "Rss")[0]) == 0 and not kv[:, :, :, :16].any()


@pytest.mark.real_model
def test_real_model_serves_from_its_gguf_blocks() -> None:
    """The default `--quantization auto`: the default model's Q4_1 and Q8_0 matrices multiplied in their blocks."""
    from engine.runtime.quantized_weights import PackedWeight

    served = chooser.build(EngineConfig(max_batch_size=2))
    assert isinstance(served.engine, HFEngine) and served.engine_thread is not None
    runner = served.engine._runner
    assert isinstance(runner.lm_head, PackedWeight) and isinstance(runner.layers[0].gate_up, PackedWeight)
    assert runner.lm_head is runner.embed  # the tied output layer: one packed copy
    assert "Paris" in complete_on(served, "The capital of France is")


def test_native_quantization_needs_a_gguf(tiny_llama_dir: str) -> None:
    from types import SimpleNamespace

    loaded = SimpleNamespace(gguf=None, blocks=None, model=AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
    with pytest.raises(ValueError, match="not a GGUF"):
        chooser.quantized_weights(loaded, "native")
    assert chooser.quantized_weights(loaded, "auto") is None  # auto: the dense path, no error
    assert chooser.quantized_weights(loaded, "none") is None


def test_int8_quantizes_a_llama_s_linear_layers_and_refuses_other_architectures(
    tiny_llama_dir: str, tiny_gpt2_dir: str
) -> None:
    from types import SimpleNamespace

    from engine.runtime.quantized_weights import SUPPORTED

    loaded = SimpleNamespace(gguf=None, blocks=None, model=AutoModelForCausalLM.from_pretrained(tiny_llama_dir))
    weights = chooser.quantized_weights(loaded, "int8")
    layers = loaded.model.config.num_hidden_layers
    assert len(weights) == layers * 7 + 1 and "lm_head.weight" in weights  # 7 projections a layer, the output
    assert {w.qtype for w in weights.values()} == {SUPPORTED["Q8_0"]}
    gpt2 = SimpleNamespace(gguf=None, blocks=None, model=AutoModelForCausalLM.from_pretrained(tiny_gpt2_dir))
    with pytest.raises(ValueError, match="llama-architecture"):
        chooser.quantized_weights(gpt2, "int8")
    assert chooser.quantized_weights(gpt2, "auto") is None


def test_a_context_longer_than_the_kv_cache_holds_is_shrunk_to_fit_unless_asked_for() -> None:
    """gpt-oss's 131,072 positions did not fit the default --kv-cache-gib and the server refused to start: without
    --max-model-len the context is shrunk to what the cache holds for one sequence (and a prompt that long still
    runs); a --max-model-len too long for the cache stays, for the engine to refuse naming both."""
    served = chooser.build(EngineConfig(max_batch_size=2, kv_cache_gib=0.01))
    engine = served.engine
    trained = 8192  # SmolLM2's
    assert 64 < engine.max_model_len < trained
    assert engine.max_model_len <= (engine.memory_stats().num_blocks - 1) * 16  # a block's room beyond one sequence
    prompt = tuple(range(100, 100 + engine.max_model_len - 2))
    engine.admit([GenerationRequest(prompt, 2, ignore_eos=True)])
    outputs = [out for _ in range(64) if engine.num_active() for out in engine.step()]
    assert sum(len(out.token_ids) for out in outputs) == 2 and outputs[-1].finish_reason == "length"
    config = EngineConfig(max_batch_size=2, kv_cache_gib=0.01, max_model_len=4096)
    assert chooser.fitted_context(None, config, trained) == 4096  # given: kept (the engine refuses it)
