"""The default GGUF served from its own blocks: no dense conversion on disk, and the same model as the converted one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def from_blocks(tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch):
    from engine.runtime import loader

    cache = tmp_path_factory.mktemp("cache")
    monkeypatch_module.setenv("SMOLSERVE_CACHE_DIR", str(cache))
    return cache, loader.load(loader.DEFAULT_MODEL, "float32", blocks=True)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_reading_the_blocks_writes_no_dense_copy(from_blocks) -> None:
    cache, loaded = from_blocks
    written = [path for path in cache.rglob("*") if path.is_file()]
    assert written and all(path.parent.name.endswith("-config") for path in written)
    assert not [path for path in written if path.suffix in (".safetensors", ".bin")]
    assert sum(path.stat().st_size for path in written) < 8 * 2**20  # config and tokenizer only
    assert loaded.blocks and loaded.gguf is not None


def test_the_blocks_are_the_files_quantized_matrices(from_blocks) -> None:
    from engine.runtime import gguf_weights

    _, loaded = from_blocks
    config = loaded.model.config
    read = gguf_weights.read(loaded.gguf, config.num_attention_heads, config.num_key_value_heads)
    assert set(read) == set(loaded.blocks)
    for name, weight in read.items():
        assert weight.qtype == loaded.blocks[name].qtype
        assert torch.equal(weight.data, loaded.blocks[name].data), name


def test_an_engine_on_the_blocks_read_alone_answers_as_on_the_converted_model(from_blocks, real_model) -> None:
    """`make serve`'s path (the blocks, no dense copy) and an engine over the converted model with the file's
    blocks give the same greedy tokens and logprobs, bit for bit."""
    from engine_helpers import make_engine, run_outputs

    from engine.core.types import GenerationRequest
    from engine.runtime import gguf_weights

    _, loaded = from_blocks
    config = real_model.model.config
    read = gguf_weights.read(real_model.gguf, config.num_attention_heads, config.num_key_value_heads)
    prompt = tuple(real_model.tokenizer("The capital of France is")["input_ids"])
    request = GenerationRequest(prompt, 12, ignore_eos=True, logprobs=0)
    outputs = [
        run_outputs(make_engine(model, loaded.eos_token_ids, quantized=blocks), [(0, request)])[0]
        for model, blocks in ((loaded.model, loaded.blocks), (real_model.model, read))
    ]
    assert outputs[0] == outputs[1] and len(outputs[0]) == 12


def test_densified_it_is_the_converted_model_bit_for_bit(from_blocks, real_model) -> None:
    """Norms and RoPE as read, every quantized matrix as the native dequantizer makes it: the same float32
    values transformers' conversion of the file gives (and the same tokenizer, EOS and context)."""
    from engine.runtime import gguf_model

    _, loaded = from_blocks
    converted = dict(real_model.model.named_parameters())
    unquantized = [n for n in converted if n not in loaded.blocks]
    assert unquantized  # the norms
    parameters = dict(loaded.model.named_parameters())
    for name in unquantized:
        assert torch.equal(parameters[name], converted[name]), name
    gguf_model.densify(loaded.model, loaded.blocks)
    for name, values in loaded.model.named_parameters():
        assert torch.equal(values, converted[name]), name
    for name, values in loaded.model.named_buffers():
        assert torch.equal(values, dict(real_model.model.named_buffers())[name]), name
    assert loaded.eos_token_ids == real_model.eos_token_ids
    assert loaded.max_position_embeddings == real_model.max_position_embeddings
    text = "Grüße, 世界! 🎉 def f(x):\n\treturn x"
    assert loaded.tokenizer(text)["input_ids"] == real_model.tokenizer(text)["input_ids"]
    assert Path(loaded.model.name_or_path) != Path(real_model.model.name_or_path)


@pytest.mark.parametrize(("native", "dtype"), [(True, torch.bfloat16), (False, torch.float32)])
def test_dtype_auto_follows_the_cpus_flags_not_a_timing(
    monkeypatch: pytest.MonkeyPatch, native: bool, dtype: torch.dtype
) -> None:
    from engine.core import cpu
    from engine.runtime import loader

    monkeypatch.setattr(cpu, "native_bf16", lambda: native)
    assert loader._pick_dtype(torch.device("cpu")) == dtype
