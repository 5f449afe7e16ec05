"""Embeddings over the fake encoder: the served-model registry (listing, routing both ways), /v1/embeddings' inputs,
encodings, usage, limits and errors (nothing reaches the encoder before every input passed), the dynamic batcher
(concurrent requests share encoder calls; the token budget while chat runs), and reading sentence-transformers
folders (pooling modes, normalization, max_seq_length, Matryoshka sizes)."""

from __future__ import annotations

import asyncio
import base64
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from app.server.app import create_app
from app.server.state import ServerConfig
from engine.chooser import ServedModel
from engine.core.embedding_batcher import IDLE_BUDGET, MIN_BUDGET, YIELD, EmbeddingBatcher
from engine.core.encoder import FakeEncoder, read_spec
from engine.core.fake_engine import FakeEngine
from engine.core.tokenizer import ByteTokenizer
from tests.app_helpers import LOCAL


def client_with(encoder: FakeEncoder, **config: Any) -> TestClient:
    served = ServedModel("chat-model", FakeEngine(max_model_len=64), ByteTokenizer(), encoder=encoder)
    return TestClient(create_app(served, ServerConfig(**config)), base_url=LOCAL)


@pytest.fixture
def encoder() -> FakeEncoder:
    return FakeEncoder(max_seq_length=32)


@pytest.fixture
def client(encoder: FakeEncoder) -> Any:
    with client_with(encoder, max_embedding_inputs=8) as c:
        yield c


def embed(client: TestClient, **fields: Any) -> dict[str, Any]:
    response = client.post("/v1/embeddings", json=fields)
    assert response.status_code == 200, response.text
    return response.json()


def test_models_lists_the_chat_model_first_then_the_embedding_model(client: TestClient) -> None:
    listed = client.get("/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in listed] == [("chat-model", 64), ("fake-embedding", 32)]
    assert client.get("/v1/models/fake-embedding").json()["id"] == "fake-embedding"
    assert client.get("/v1/models/nope").status_code == 404


def test_requests_route_by_model_both_ways(client: TestClient) -> None:
    wrong = client.post("/v1/embeddings", json={"model": "chat-model", "input": "hi"})
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "model"
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ):
        response = client.post(path, json={"model": "fake-embedding", **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == "model", path
    assert client.post("/v1/embeddings", json={"model": "nope", "input": "hi"}).status_code == 404
    assert embed(client, input="hi")["model"] == "fake-embedding"  # no model named: the embedding model


def test_aliases_name_the_same_models(encoder: FakeEncoder) -> None:
    with client_with(encoder, served_model_name="chat", model_aliases=("gpt-4o-mini",),
                     embedding_model_names=("text-embedding-3-small", "emb")) as c:  # fmt: skip
        ids = [m["id"] for m in c.get("/v1/models").json()["data"]]
        assert ids == ["chat", "gpt-4o-mini", "text-embedding-3-small", "emb"]
        assert embed(c, model="emb", input="x")["model"] == "text-embedding-3-small"
        chat = c.post(
            "/v1/chat/completions", json={"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "x"}]}
        )
        assert chat.status_code == 200 and chat.json()["model"] == "chat"


def test_every_input_shape_and_the_usage(client: TestClient, encoder: FakeEncoder) -> None:
    one = embed(client, input="hello")
    assert one["object"] == "list" and [d["index"] for d in one["data"]] == [0]
    assert one["data"][0]["object"] == "embedding" and len(one["data"][0]["embedding"]) == 8
    assert one["usage"] == {"prompt_tokens": 7, "total_tokens": 7}  # the model's own special tokens counted
    texts = embed(client, input=["hello", "a", "hello"])
    vectors = [d["embedding"] for d in texts["data"]]
    assert vectors[0] == vectors[2] == one["data"][0]["embedding"] and vectors[1] != vectors[0]
    ids = encoder.tokenize("hello", None)
    assert embed(client, input=ids)["data"][0]["embedding"] == vectors[0]  # token ids = the text
    both = embed(client, input=[ids, encoder.tokenize("a", None)])
    assert [d["embedding"] for d in both["data"]] == vectors[:2] and both["usage"]["prompt_tokens"] == 7 + 3


def test_base64_is_little_endian_float32_of_the_same_vector(client: TestClient) -> None:
    floats = embed(client, input="hello")["data"][0]["embedding"]
    encoded = embed(client, input="hello", encoding_format="base64")["data"][0]["embedding"]
    raw = base64.b64decode(encoded)
    assert len(raw) == 4 * 8
    assert list(struct.unpack("<8f", raw)) == [struct.unpack("<f", struct.pack("<f", x))[0] for x in floats]


def test_truncation_keeps_the_beginning(client: TestClient, encoder: FakeEncoder) -> None:
    long = "x" * 40 + "tail"
    assert embed(client, input=long, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 32
    cut = embed(client, input=long, truncate_prompt_tokens=10)
    assert cut["usage"]["prompt_tokens"] == 10
    assert cut["data"][0]["embedding"] == embed(client, input=encoder.tokenize(long, 10))["data"][0]["embedding"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": 42}, "input"),
        ({"input": ["a", 1]}, "input"),
        ({"input": [1, -2]}, "input"),
        ({"input": [5, 999]}, "input"),
        ({"input": ["a"] * 9}, "input"),
        ({"input": ["a", "y" * 50]}, "input[1]"),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "a", "dimensions": 4}, "dimensions"),
        ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_400_naming_it_and_reaches_no_model(
    client: TestClient, encoder: FakeEncoder, fields: dict[str, Any], param: str
) -> None:
    response = client.post("/v1/embeddings", json=fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]
    assert encoder.batches == []


def test_over_the_limit_names_the_limit(client: TestClient) -> None:
    message = client.post("/v1/embeddings", json={"input": "y" * 50}).json()["error"]["message"]
    assert "52 tokens" in message and "at most 32" in message and "truncate_prompt_tokens" in message


def test_metrics_count_requests_inputs_tokens_and_batches(client: TestClient) -> None:
    embed(client, input=["a", "bb"])
    text = client.get("/metrics").text
    for line in (
        'smolserve:embedding_requests_total{model="fake-embedding"} 1.0',
        'smolserve:embedding_inputs_total{model="fake-embedding"} 2.0',
        'smolserve:embedding_prompt_tokens_total{model="fake-embedding"} 7.0',
        'smolserve:embedding_batch_size_count{model="fake-embedding"} 1.0',
    ):
        assert line in text


# -- the batcher ----------------------------------------------------------------------------------------------


def test_concurrent_requests_share_encoder_calls_shortest_first() -> None:
    encoder = FakeEncoder()

    async def run() -> list[list[list[float]]]:
        batcher = EmbeddingBatcher(encoder, None)
        await batcher.start()
        try:
            requests = [[encoder.tokenize("x" * (n % 7), None)] * 2 for n in range(10)]
            return await asyncio.gather(*(batcher.encode(r) for r in requests))
        finally:
            await batcher.stop()

    results = asyncio.run(run())
    assert sum(encoder.batches) == 20 and len(encoder.batches) < 10  # fewer calls than requests
    for n, vectors in enumerate(results):  # each its own vectors, whatever batch they rode in
        assert vectors == encoder.encode([encoder.tokenize("x" * (n % 7), None)] * 2)


def test_while_chat_runs_a_batch_takes_about_one_step_of_encoder_time() -> None:
    encoder = FakeEncoder()
    idle = EmbeddingBatcher(encoder, None)
    assert idle.budget() == IDLE_BUDGET
    busy = EmbeddingBatcher(encoder, None, chat_step_seconds=lambda: 0.010)
    assert busy.budget() == 200  # 10 ms at the first guess of 20,000 tokens a second
    assert EmbeddingBatcher(encoder, None, chat_step_seconds=lambda: 0.0001).budget() == MIN_BUDGET


@pytest.mark.parametrize("chat_running", [True, False])
def test_after_each_batch_the_thread_is_left_to_chat_for_longer_than_the_batch(chat_running: bool) -> None:
    """While chat generates, each batch of ``t`` seconds is followed by ``YIELD * t`` of chat's (embeddings at most
    40% of the thread, most chat tokens a step after the last); when chat is idle, batches follow one another."""
    encoder = FakeEncoder()
    ticks = iter(range(0, 1000, 2))  # each batch takes 2 "seconds" on this clock
    pauses: list[float] = []

    async def pause(seconds: float) -> None:
        pauses.append(seconds)

    async def run() -> None:
        step = (lambda: 0.0001) if chat_running else (lambda: None)
        batcher = EmbeddingBatcher(encoder, None, step, clock=lambda: next(ticks), pause=pause)
        await batcher.start()
        try:
            for n in range(3):  # three requests one after another: three batches
                await batcher.encode([encoder.tokenize("x" * (n + 1), None)])
        finally:
            await batcher.stop()

    asyncio.run(run())
    assert pauses == ([YIELD * 2] * 3 if chat_running else [])


# -- reading a sentence-transformers folder ------------------------------------------------------------------


def folder(tmp_path: Path, pooling: dict[str, bool] | None, normalize: bool = True, **config: Any) -> Path:
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    if pooling is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        (tmp_path / "1_Pooling").mkdir()
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling}))
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128, "do_lower_case": True}))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


@pytest.mark.parametrize(
    ("pooling", "modes"),
    [
        ({"pooling_mode_mean_tokens": True}, ("mean",)),
        ({"pooling_mode_cls_token": True}, ("cls",)),
        ({"pooling_mode_max_tokens": True}, ("max",)),
        ({"pooling_mode_mean_sqrt_len_tokens": True}, ("mean_sqrt_len",)),
        ({"pooling_mode_lasttoken": True}, ("lasttoken",)),
        ({"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}, ("cls", "mean")),
    ],
)
def test_pooling_modes_are_read_in_sentence_transformers_order(
    tmp_path: Path, pooling: dict[str, bool], modes: tuple[str, ...]
) -> None:
    spec = read_spec(folder(tmp_path, pooling))
    assert spec.pooling == modes and spec.normalize and spec.max_seq_length == 128 and spec.do_lower_case


def test_no_normalize_module_no_pooling_and_matryoshka(tmp_path: Path) -> None:
    spec = read_spec(folder(tmp_path, None, normalize=False, matryoshka_dimensions=[64, 128]))
    assert spec.pooling == ("cls",) and not spec.normalize and spec.matryoshka_dims == (64, 128)


def test_a_plain_hf_directory_is_mean_pooled_and_normalized(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    spec = read_spec(tmp_path)
    assert (spec.pooling, spec.normalize, spec.max_seq_length) == (("mean",), True, None)


def test_what_this_server_cannot_pool_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="weighted-mean"):
        read_spec(folder(tmp_path, {"pooling_mode_weightedmean_tokens": True}))
