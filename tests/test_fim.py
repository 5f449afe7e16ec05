"""Fill-in-the-middle: the FIM tokens of each family, the prompt in llama.cpp's order and cut as it cuts, ``suffix``
on ``/v1/completions`` and llama.cpp's ``/infill`` on a tiny qwen2 GGUF whose vocabulary has Qwen2.5-Coder's FIM
tokens (the Qwen2.5-Coder file itself: ``tests/test_user_model.py``), and a model without them refusing both."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core import fim
from tests.app_helpers import LOCAL

QWEN = {"<|fim_prefix|>": 1, "<|fim_suffix|>": 2, "<|fim_middle|>": 3, "<|fim_pad|>": 4, "<|endoftext|>": 0,
        "<|repo_name|>": 5, "<|file_sep|>": 6}  # fmt: skip


def chars(text: str) -> list[int]:
    """A stand-in tokenizer: one id (100 + code point) per character."""
    return [100 + ord(c) for c in text]


@pytest.mark.parametrize(
    ("vocab", "family", "ends"),
    [
        (QWEN, "qwen", {0, 4, 5, 6}),
        ({"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<fim_pad>": 4, "<|endoftext|>": 0}, "starcoder",
         {0, 4}),
        ({"\u2581<PRE>": 32007, "\u2581<SUF>": 32008, "\u2581<MID>": 32009, "\u2581<EOT>": 32010}, "codellama",
         {32010}),
        ({"<\uff5cfim\u2581begin\uff5c>": 1, "<\uff5cfim\u2581hole\uff5c>": 2, "<\uff5cfim\u2581end\uff5c>": 3},
         "deepseek-coder", set()),
    ],
)  # fmt: skip
def test_each_family_s_tokens_are_found_in_its_vocabulary(vocab: dict[str, int], family: str, ends: set[int]) -> None:
    found = fim.find(vocab)
    assert found is not None and found.family == family and found.ends == ends


def test_a_vocabulary_without_all_three_has_none() -> None:
    assert fim.find({"<|fim_prefix|>": 1, "<|fim_suffix|>": 2}) is None


def test_the_prompt_is_llama_cpp_s_repository_level_layout() -> None:
    """[repo]myproject\\n [file_sep]a.py\\n text [file_sep]filename\\n BOS [prefix] prefix prompt [suffix] suffix
    [middle]: ``format_prompt_infill`` in llama.cpp's server."""
    tokens = fim.find(QWEN)
    assert tokens is not None
    got = fim.layout(tokens, chars, fim.Infill("def f(", "):", "x", [("a.py", "A")]), bos=[9])
    assert got == [5, *chars("myproject\n"), 6, *chars("a.py\n"), *chars("A"), 6, *chars("filename\n"), 9, 1,
                   *chars("def f("), *chars("x"), 2, *chars("):"), 3]  # fmt: skip
    starcoder = fim.find({"<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3})
    assert starcoder is not None  # no file separator: each chunk after llama.cpp's snippet line
    assert fim.layout(starcoder, chars, fim.Infill("p", "s", "", [("a", "A")])) == [
        *chars(fim.SNIPPET), *chars("A"), 1, *chars("p"), 3, *chars("s"), 2,
    ]  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    prefix=st.text(max_size=60), suffix=st.text(max_size=60), typed=st.text(max_size=5),
    extra=st.lists(st.tuples(st.text(max_size=5), st.text(max_size=40)), max_size=3), room=st.integers(12, 200),
)  # fmt: skip
def test_a_cut_prompt_fits_its_room_and_keeps_the_text_nearest_the_gap(
    prefix: str, suffix: str, typed: str, extra: list[tuple[str, str]], room: int
) -> None:
    tokens = fim.find(QWEN)
    assert tokens is not None
    got = fim.layout(tokens, chars, fim.Infill(prefix, suffix, typed, extra), room=room)
    assert len(got) <= max(room, 4 + len(typed))
    kept_prefix = got[got.index(1) + 1 : got.index(2) - len(typed)]
    kept_suffix = got[got.index(2) + 1 : got.index(3)]
    assert kept_prefix == chars(prefix)[len(chars(prefix)) - len(kept_prefix) :]  # the prefix's end
    assert kept_suffix == chars(suffix)[: len(kept_suffix)]  # the suffix's start
    if len(prefix) + len(suffix) + len(typed) + 4 <= 3 * room // 4:  # room for all of both
        assert kept_prefix == chars(prefix) and kept_suffix == chars(suffix)


def test_the_cutter_stops_at_a_shallower_line_and_after_the_time_limit() -> None:
    """llama.cpp's ``n_indent``: after the first line break, a line indented less ends the text where its
    indentation ends; ``t_max_predict_ms``: a token with a line break after the limit ends it."""
    from app.api.infill import Cutter

    cutter = Cutter(4, 0)
    sent = [cutter.feed(piece) for piece in ["x = 1\n", "    y", " = 2\n", "\n", "  z", "never"]]
    assert "".join(sent) == "x = 1\n    y = 2\n\n  " and cutter.stopped
    clock = iter([0.0, 0.5, 2.0, 2.0])
    timed = Cutter(0, 1000, clock=lambda: next(clock))
    assert timed.feed("a\n") == "a\n" and not timed.stopped  # 0.5 s in
    assert timed.feed("b") == "b" and not timed.stopped  # no line break
    assert timed.feed("c\n") == "c\n" and timed.stopped  # 2 s in, a line break


# -- over HTTP, on a tiny model with FIM tokens ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fim_client(tmp_path_factory: pytest.TempPathFactory):
    from gguf import GGMLQuantizationType as T
    from gguf_files import QWEN_FIM, tiny_model, write_gguf
    from starlette.testclient import TestClient

    from app.server.app import create_app
    from app.server.state import ServerConfig
    from engine.chooser import build
    from engine.core.config import EngineConfig
    from engine.runtime import loader

    root = tmp_path_factory.mktemp("fim")
    path = root / "tiny-coder.gguf"
    types = {kind: T.Q8_0 for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    write_gguf(tiny_model("qwen2", vocab=49152), "qwen2", path, loader._default_gguf(), types, renamed=QWEN_FIM)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(root / "cache"))
        served = build(EngineConfig(model=str(path), kv_cache_gib=0.25, max_model_len=512, embedding_model="none"))
    with TestClient(create_app(served, ServerConfig()), base_url=LOCAL) as client:
        yield client, served


def expected_prompt(served, prefix: str, suffix: str, typed: str = "") -> list[int]:
    tokenizer = served.tokenizer
    encode = tokenizer.encode
    return [7, *encode(prefix, False), *encode(typed, False), 8, *encode(suffix, False), 9]


def test_suffix_fills_the_middle_and_ends_at_an_end_of_middle_token(fim_client) -> None:
    client, served = fim_client
    body = {"model": served.name, "prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n",
            "max_tokens": 8, "temperature": 0}  # fmt: skip
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] == len(expected_prompt(served, body["prompt"], body["suffix"]))
    # <|fim_pad|> made certain: the middle ends at once, without the token's text
    ended = client.post("/v1/completions", json={**body, "logit_bias": {"10": 100}}).json()["choices"][0]
    assert ended["text"] == "" and ended["finish_reason"] == "stop"
    refused = client.post("/v1/completions", json={**body, "prompt": [1, 2, 3]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "prompt"
    echoed = client.post("/v1/completions", json={**body, "echo": True})
    assert echoed.status_code == 400 and echoed.json()["error"]["param"] == "echo"


def test_infill_answers_as_llama_cpp_s_server(fim_client) -> None:
    """llama.vscode's request (its fields, llama.cpp's sampling defaults): ``content`` and the fields it reads."""
    client, served = fim_client
    body = {"input_prefix": "def add(a, b):\n", "input_suffix": "\n", "prompt": "    return ",
            "input_extra": [{"filename": "util.py", "text": "def sub(a, b):\n    return a - b\n", "time": 1}],
            "n_predict": 6, "top_k": 40, "top_p": 0.99, "stream": False, "samplers": ["top_k", "top_p", "infill"],
            "cache_prompt": True, "t_max_prompt_ms": 500, "t_max_predict_ms": 1000, "n_indent": 4,
            "seed": 1}  # fmt: skip
    answer = client.post("/infill", json=body)
    assert answer.status_code == 200, answer.text
    got = answer.json()
    assert got["stop"] is True and got["stop_type"] in ("eos", "limit") and isinstance(got["content"], str)
    tokenizer = served.tokenizer
    infill = fim.Infill(
        body["input_prefix"], body["input_suffix"], body["prompt"], [("util.py", body["input_extra"][0]["text"])]
    )
    expected = fim.layout(tokenizer.fim, lambda text: tokenizer.encode(text, False), infill, tokenizer.start_ids)
    assert got["tokens_predicted"] <= 6 and got["tokens_evaluated"] == len(expected)
    assert got["generation_settings"]["top_k"] == 40 and got["timings"]["predicted_n"] == got["tokens_predicted"]
    assert got["model"] == served.name and "util.py" in got["prompt"]
    ended = client.post("/infill", json={**body, "n_predict": 0}).json()
    assert ended["content"] == "" and ended["stop_type"] == "limit"


def test_infill_streams_llama_cpp_s_objects(fim_client) -> None:
    from app_helpers import sse_events

    client, _ = fim_client
    body = {"input_prefix": "x = ", "input_suffix": "\n", "n_predict": 5, "temperature": 0, "stream": True}
    events = [json.loads(event) for event in sse_events(client, body, "/infill")]
    assert all(event["stop"] is False for event in events[:-1]) and events[-1]["stop"] is True
    assert "".join(event["content"] for event in events[:-1]) == events[-1]["content"]
    whole = client.post("/infill", json={**body, "stream": False}).json()
    assert whole["content"] == events[-1]["content"]  # greedy: the same middle streamed or not


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input_suffix": ""}, "input_prefix"),
        ({"input_prefix": "", "input_suffix": 3}, "input_suffix"),
        ({"input_prefix": "", "input_suffix": "", "lora": [{"id": 0, "scale": 0.5}]}, "lora"),
        ({"input_prefix": "", "input_suffix": "", "input_extra": [{"filename": "a"}]}, "input_extra"),
        ({"input_prefix": "", "input_suffix": "", "samplers": ["dry"]}, "samplers"),
        ({"input_prefix": "", "input_suffix": "", "n_predict": -2}, "n_predict"),
        ({"input_prefix": "", "input_suffix": "", "n_indent": "4"}, "n_indent"),
    ],
)
def test_infill_refuses_what_it_cannot_do_naming_the_field(fim_client, body: dict, param: str) -> None:
    client, _ = fim_client
    answer = client.post("/infill", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_a_model_without_fim_tokens_refuses_suffix_and_infill_saying_why() -> None:
    from app_helpers import fake_client

    with fake_client() as client:
        answer = client.post("/v1/completions", json={"prompt": "a", "suffix": "b", "max_tokens": 2})
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "suffix"
        assert "has none" in answer.json()["error"]["message"]
        answer = client.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
        assert answer.status_code == 400 and "FIM tokens" in answer.json()["error"]["message"]
        chat = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a"}], "suffix": "b"})
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "suffix"


def test_the_bundled_model_has_no_fim_tokens(real_model) -> None:
    """SmolLM2's vocabulary has StarCoder's repository tokens but not its FIM ones: a 400, not a made-up layout."""
    from engine.core.tokenizer import HFTokenizer

    assert HFTokenizer(real_model.tokenizer, real_model.eos_token_ids).fim is None


def test_ollama_s_generate_fills_the_middle_as_completions_suffix_does(fim_client) -> None:
    """``/api/generate`` with ``suffix`` (as Ollama's coder integrations send it): the same prompt and greedy middle
    as ``/v1/completions``' ``suffix``."""
    client, served = fim_client
    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    body = {"model": served.name, "prompt": prefix, "suffix": suffix, "stream": False,
            "options": {"num_predict": 8, "temperature": 0}}  # fmt: skip
    native = client.post("/api/generate", json=body)
    assert native.status_code == 200, native.text
    completion = client.post("/v1/completions", json={"model": served.name, "prompt": prefix, "suffix": suffix,
                                                      "max_tokens": 8, "temperature": 0}).json()  # fmt: skip
    assert native.json()["prompt_eval_count"] == len(expected_prompt(served, prefix, suffix))
    assert native.json()["response"] == completion["choices"][0]["text"]
