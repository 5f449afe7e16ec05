"""Build the engine and tokenizer a config names. Heavy backends are imported only when chosen."""

from __future__ import annotations

from dataclasses import dataclass

from engine.base import InferenceEngine
from engine.config import EngineConfig
from engine.fake_engine import FakeEngine
from engine.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer


@dataclass(slots=True)
class ServedModel:
    name: str
    engine: InferenceEngine
    tokenizer: Tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len


def build(config: EngineConfig) -> ServedModel:
    if config.model == "fake":
        engine = FakeEngine(capacity=config.max_batch_size, max_model_len=config.max_model_len or 2048)
        return ServedModel("fake", engine, ByteTokenizer())
    from engine import loader
    from engine.hf_engine import HFEngine

    loaded = loader.load(config.model, config.dtype)
    max_model_len = min(config.max_model_len or loaded.max_position_embeddings, loaded.max_position_embeddings)
    hf_engine = HFEngine(
        loaded.model,
        eos_token_ids=loaded.eos_token_ids,
        capacity=config.max_batch_size,
        max_model_len=max_model_len,
        kv_cache_bytes=int(config.kv_cache_gib * 2**30),
        max_num_batched_tokens=config.max_num_batched_tokens,
        compile=config.compile,
    )
    return ServedModel(loaded.name, hf_engine, HFTokenizer(loaded.tokenizer, loaded.eos_token_ids))
