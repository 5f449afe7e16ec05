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

from engine import chooser, kernels
from engine.config import EngineConfig
from engine.hf_engine import HFEngine
from engine.kv_cache import SlotKVCache
from engine.scheduler import Scheduler
from engine.tokenizer import HFTokenizer
from engine.types import GenerationRequest


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
    assert engine.cache.kv is not None  # idle: KV memory kept for the next requests...
    engine.release_idle_memory()
    assert engine.cache.kv is None  # ...until the scheduler asks for it back


def test_kv_budget_makes_admission_wait(tiny_pair) -> None:
    model, _ = tiny_pair
    engine = make_engine(model, frozenset({7}), max_model_len=100, kv_cache_bytes=100 * engine_bytes_per_token(model))
    first = GenerationRequest(prompt_ids(1, 30), 10)  # reserves 40 of the 100 tokens
    assert engine.can_admit(first)
    engine.admit([first])
    assert engine.can_admit(first)  # two of 40 fit in 100
    engine.admit([first])
    assert not engine.can_admit(first)  # a third would need 3 x 40 = 120
    assert not engine.can_admit(GenerationRequest(prompt_ids(1, 2), 2))  # slots span the longest: 3 x 40
    while engine.num_active():
        engine.step()
    assert engine.can_admit(first)


def engine_bytes_per_token(model: PreTrainedModel) -> int:
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", config.num_attention_heads)
    return config.num_hidden_layers * 2 * kv_heads * head_dim * 4


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


def test_int8_cache_keeps_each_slot_through_insert_write_growth_and_move() -> None:
    """What a slot of the 8-bit cache attends over is what was stored there: prompts inserted from staging,
    tokens written one by one, kept when the cache grows, and carried by a move into another slot."""
    torch.manual_seed(0)
    layers, heads, groups, dim = 2, 2, 3, 16
    cache = SlotKVCache(layers, heads, dim, torch.float32, torch.device("cpu"), "int8")
    assert cache.quantized and cache.bytes_per_token == layers * 2 * heads * (dim + 4)
    cache.reserve(2, 32, max_slots=4, max_positions=512)
    stored: list[torch.Tensor] = []  # per slot: [layers, 2, heads, positions, dim]
    for slot, prompt_len in enumerate((18, 5)):
        staging = cache.new_staging(prompt_len)
        staging[:, :, :, :prompt_len] = torch.randn(layers, 2, heads, prompt_len, dim)
        cache.insert(slot, staging)
        stored.append(staging[:, :, :, :prompt_len].clone())
    for _ in range(2):  # two decode steps: one new token per slot
        new = torch.randn(layers, 2, 2, heads, dim)  # [layers, key/value, slot, heads, dim]
        positions = torch.tensor([seq.shape[3] for seq in stored])
        for layer in range(layers):
            cache.write(layer, torch.arange(2), positions, new[layer, 0], new[layer, 1])
        stored = [torch.cat([seq, new[:, :, slot, :, None]], dim=3) for slot, seq in enumerate(stored)]
    cache.reserve(2, 300, max_slots=4, max_positions=512)  # grows: a copy of everything held
    cache.move(1, 0, stored[1].shape[3])  # slot 0 leaves; slot 1's sequence takes its place
    query = torch.randn(1, heads, groups, dim)
    for layer in range(layers):
        got = cache.attend_int8(layer, query, torch.tensor([stored[1].shape[3]]), dim**-0.5)
        keys, values = stored[1][layer]
        want = torch.nn.functional.scaled_dot_product_attention(query, keys[None], values[None])
        torch.testing.assert_close(got, want, atol=6e-2, rtol=6e-2)


def test_int8_cache_refuses_a_head_size_its_kernels_do_not_take() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        SlotKVCache(2, 1, 6, torch.float32, torch.device("cpu"), "int8")


@pytest.mark.real_model
def test_real_model_serves_from_an_int8_cache() -> None:
    served = chooser.build(EngineConfig(max_batch_size=2, kv_cache_dtype="int8"))
    assert isinstance(served.engine, HFEngine) and served.engine.cache.quantized
    assert served.engine_thread is not None
    prompt = tuple(served.tokenizer.encode("The capital of France is"))

    async def generate() -> str:
        scheduler = Scheduler(served.engine, served.tokenizer, engine_thread=served.engine_thread)
        await scheduler.start()
        stream = scheduler.submit(GenerationRequest(prompt, 8))
        text = "".join([delta.text async for delta in stream.deltas()])
        await scheduler.stop()
        return text

    assert "Paris" in asyncio.run(generate())
    served.engine_thread.shutdown()


def test_cache_grows_in_slots_geometrically_within_the_token_budget() -> None:
    """Each growth copies everything held, so a burst of arrivals must not grow the cache once per handful of
    newcomers; spare slots stay within the KV budget."""
    cache = SlotKVCache(2, 1, 16, torch.float32, torch.device("cpu"))
    grown = []
    for arrived in range(1, 41):
        cache.reserve(arrived, 100, max_slots=64, max_positions=512, max_tokens=48 * 256)
        if not grown or grown[-1] != cache.num_slots:
            grown.append(cache.num_slots)
    assert grown == [4, 8, 16, 32, 48]  # 64 would pass the budget of 48 slots of 256 positions
    assert cache.num_positions == 256


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds ``address`` (Linux)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError("no mapping holds the address")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="needs Linux's /proc")
def test_large_kv_storage_is_zeroed_and_asked_for_huge_pages() -> None:
    from engine.os_memory import zeros_in_huge_pages

    shape = (2, 2, 8, 3, 1024, 64)  # 12 MiB
    kv = zeros_in_huge_pages(shape, torch.bfloat16, torch.device("cpu"))
    assert kv.shape == shape and kv.dtype == torch.bfloat16 and kv.is_contiguous()
    assert not kv.any()
    assert kv.data_ptr() % (2 << 20) == 0
    assert "hg" in _vm_flags(kv.data_ptr())  # madvise(MADV_HUGEPAGE) reached the kernel
    cache = SlotKVCache(2, 3, 64, torch.bfloat16, torch.device("cpu"))
    cache.reserve(8, 1024, 8, 1024)
    assert cache.kv is not None and "hg" in _vm_flags(cache.kv.data_ptr())


def test_growth_keeps_only_live_slots_and_idle_storage_is_reused() -> None:
    cache = SlotKVCache(2, 1, 4, torch.float32, torch.device("cpu"))
    cache.reserve(2, 16, max_slots=16, max_positions=64)
    assert cache.kv is not None and cache.num_slots == 4
    cache.kv[:, :, 0] = 1.0
    cache.kv[:, :, 1] = 2.0
    cache.reserve(6, 16, max_slots=16, max_positions=64, live_slots=1)  # slot 1's sequence has left
    assert cache.num_slots == 8
    assert bool((cache.kv[:, :, 0] == 1.0).all()) and bool((cache.kv[:, :, 1:] == 0.0).all())
    cache.kv.fill_(3.0)
    storage = cache.kv.data_ptr()
    cache.reserve(5, 16, max_slots=16, max_positions=64, live_slots=0)  # a new burst that fits: same storage
    assert cache.kv.data_ptr() == storage
    cache.reserve(12, 16, max_slots=16, max_positions=64, live_slots=0)  # one that does not: fresh, not copied
    assert cache.num_slots == 12 and bool((cache.kv == 0.0).all())  # sized afresh
