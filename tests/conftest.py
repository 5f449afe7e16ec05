"""Shared fixtures: engines for the contract tests, the real default model, a tiny random llama."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Nothing a test writes to the default --data-dir (the prefix cache's blocks on disk, uploads) outlives the run, nor
# does a test find what another run left there.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="smolserve-tests-")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A randomly initialised 2-layer llama with grouped-query attention, saved like a hub checkout."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=7,
        bos_token_id=1,
        pad_token_id=0,
    )
    model = LlamaForCausalLM(config)
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def real_model():
    """The default model, loaded once per test session (converted from GGUF on first use)."""
    from engine.runtime import loader

    return loader.load(loader.DEFAULT_MODEL)


@pytest.fixture(scope="session")
def tiny_gpt2_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A randomly initialised 2-layer GPT-2: an architecture the lean llama runner does not cover."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=300, n_embd=64, n_layer=2, n_head=4, n_positions=512, eos_token_id=7, bos_token_id=1)
    path = tmp_path_factory.mktemp("tiny-gpt2")
    GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def served_model():
    """The default model as `make serve` loads it: dtype `auto` (bfloat16 where this CPU runs it faster)."""
    from engine.runtime import loader

    return loader.load(loader.DEFAULT_MODEL, "auto")


@pytest.fixture(scope="session")
def real_reference_model(real_model):
    """An untouched float32 copy of the default model, for `generate`."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model.model.name_or_path).eval()
