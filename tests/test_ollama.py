"""Ollama's API (``app/wire/ollama/``) over the fake engine: the newline-delimited stream, whole answers, options and
fields refused by name, ``keep_alive`` (a duration; 0 unloads), errors in Ollama's envelope. The official client on
the real model: ``compat/test_ollama_client.py``."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from app_helpers import fake_client
from test_several_models import Builds, _lifespan, served

from app.wire.ollama.request import keep_alive

ASK = [{"role": "user", "content": "hi"}]


def chat(client, **body: Any):
    return client.post("/api/chat", json={"model": "fake", "messages": ASK, **body})


def test_the_stream_is_one_json_object_a_line_ending_done_and_equal_to_the_whole() -> None:
    with fake_client() as client:
        streamed = chat(client, options={"num_predict": 6})
        assert streamed.status_code == 200 and streamed.headers["content-type"] == "application/x-ndjson"
        lines = [json.loads(line) for line in streamed.text.splitlines()]
        assert all(not line["done"] for line in lines[:-1]) and lines[-1]["done"]
        whole = chat(client, stream=False, options={"num_predict": 6}).json()
    assert "".join(line["message"]["content"] for line in lines) == whole["message"]["content"]
    assert lines[-1]["eval_count"] == whole["eval_count"] == 6 and whole["done_reason"] == "length"
    assert whole["prompt_eval_count"] > 0 and whole["total_duration"] >= whole["eval_duration"] > 0


def test_generate_returns_the_context_and_takes_it_back() -> None:
    with fake_client() as client:
        first = client.post("/api/generate", json={"model": "fake:latest", "prompt": "ab", "raw": True,
                                                   "stream": False, "options": {"num_predict": 3}}).json()  # fmt: skip
        assert first["context"] == [*b"ab", *first["response"].encode()]
        turn = {"model": "fake", "prompt": "c", "raw": True, "stream": False, "context": first["context"],
                "options": {"num_predict": 1}}  # fmt: skip
        again = client.post("/api/generate", json=turn)
        assert again.json()["prompt_eval_count"] == len(first["context"]) + 1


@pytest.mark.parametrize(("body", "named"), [
    ({"options": {"mirostat": 1}}, "options.mirostat"),
    ({"options": {"num_ctx": 100_000}}, "options.num_ctx"),
    ({"options": {"no_such_option": 1}}, "options.no_such_option"),
    ({"messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, "images"),
    ({"format": "yaml"}, "format"),
    ({"think": True}, "thinking"),
    ({"keep_alive": "soon"}, "keep_alive"),
])  # fmt: skip
def test_what_is_not_implemented_is_a_400_in_ollama_s_envelope(body: dict[str, Any], named: str) -> None:
    with fake_client() as client:
        response = chat(client, **body)
    assert response.status_code == 400 and named in response.json()["error"]


def test_runtime_options_and_off_values_are_accepted() -> None:
    options = {"num_thread": 2, "num_gpu": 0, "use_mmap": True, "num_ctx": 64, "mirostat": 0, "typical_p": 1.0,
               "num_predict": -1, "temperature": 0}  # fmt: skip
    with fake_client() as client:
        assert chat(client, stream=False, options=options).json()["done"]


def test_an_unknown_model_is_ollama_s_404_and_the_listings_name_the_model_tagged() -> None:
    with fake_client() as client:
        missing = chat(client, model="nope")
        assert missing.status_code == 404 and missing.json() == {"error": "model 'nope' not found"}
        assert [m["name"] for m in client.get("/api/tags").json()["models"]] == ["fake:latest"]
        assert client.get("/").text == "Ollama is running" and client.head("/").status_code == 200
        assert client.post("/api/show", json={"model": "fake"}).json()["model_info"]["llama.context_length"] == 64


@pytest.mark.parametrize(("value", "seconds"), [
    (None, None), (300, 300.0), ("5m", 300.0), ("1h30m", 5400.0), ("0", 0.0), ("-1", -1.0), ("-1m", -60.0),
    ("1.5s", 1.5), (0, 0.0),
])  # fmt: skip
def test_keep_alive_reads_seconds_and_go_durations(value: Any, seconds: float | None) -> None:
    assert keep_alive(value) == seconds


def test_keep_alive_zero_unloads_and_a_duration_is_what_ps_reports() -> None:
    builds = Builds()

    async def body() -> None:
        app, client = await served(builds, ["beta"])
        pool = app.state.server.pool
        async with client:

            async def check() -> None:
                asked = {"model": "beta", "messages": ASK, "stream": False, "keep_alive": "10m"}
                assert (await client.post("/api/chat", json=asked)).json()["done"]
                (beta,) = [m for m in (await client.get("/api/ps")).json()["models"] if m["name"] == "beta:latest"]
                assert beta["expires_at"] != "2318-06-07T00:00:00Z" and pool.entry("beta").keep_alive_s == 600
                unload = await client.post("/api/generate", json={"model": "beta", "keep_alive": 0})
                assert unload.json()["done_reason"] == "unload" and pool.entry("beta").model is None
                load = await client.post("/api/generate", json={"model": "beta"})
                assert load.json()["done_reason"] == "load" and pool.entry("beta").model is not None

            await _lifespan(app, check)

    asyncio.run(body())


def test_pull_of_a_served_model_succeeds_and_of_any_other_is_a_404() -> None:
    """As ``codex --oss`` pulls the model it was given before its first turn (after ``/api/version`` >= 0.13.4)."""
    with fake_client() as client:
        lines = [json.loads(line) for line in client.post("/api/pull", json={"model": "fake"}).text.splitlines()]
        assert lines[-1] == {"status": "success"}
        assert client.post("/api/pull", json={"model": "fake", "stream": False}).json() == {"status": "success"}
        missing = client.post("/api/pull", json={"model": "llama3.2"})
        assert missing.status_code == 404 and "local files" in missing.json()["error"]
        refused = client.post("/api/push", json={"model": "fake"})
        assert refused.status_code == 400 and "registry" in refused.json()["error"]
        assert tuple(map(int, client.get("/api/version").json()["version"].split("."))) >= (0, 13, 4)


def test_suffix_on_a_model_without_fim_tokens_is_a_400_saying_why() -> None:
    with fake_client() as client:
        response = client.post("/api/generate", json={"model": "fake", "prompt": "a", "suffix": "b"})
        at_start = client.post("/api/generate", json={"model": "fake", "suffix": "b"})  # a gap at the file's start
        thinking = client.post("/api/generate", json={"model": "fake", "prompt": "a", "think": True})
    assert response.status_code == 400 and "fill-in-the-middle" in response.json()["error"]
    assert at_start.status_code == 400 and "fill-in-the-middle" in at_start.json()["error"]
    assert thinking.status_code == 400 and "does not support thinking" in thinking.json()["error"]


def _made(client, name: str) -> dict[str, Any] | None:
    return next((m for m in client.get("/api/tags").json()["models"] if m["name"] == f"{name}:latest"), None)


def test_a_made_model_answers_with_its_own_options_and_system_prompt_and_outlives_a_restart(tmp_path) -> None:
    """``/api/create`` from a served model: listed with it as the parent, answering under its own name with its
    parameters (a request's own options win) and system prompt, on ``/api/chat``, ``/api/generate`` and
    ``/v1/chat/completions``; shown with its Modelfile; copied; deleted; kept in ``--data-dir`` across a restart."""
    made = {"model": "terse", "from": "fake:latest", "system": "Answer in one word.",
            "parameters": {"num_predict": 3, "stop": ["zz"]}}  # fmt: skip
    with fake_client(data_dir=tmp_path) as client:
        lines = [json.loads(line) for line in client.post("/api/create", json=made).text.splitlines()]
        assert lines[-1] == {"status": "success"}
        assert _made(client, "terse")["details"]["parent_model"] == "fake:latest"  # type: ignore[index]
        answer = chat(client, model="terse", stream=False).json()
        assert chat(client, model="terse:latest", stream=False).json()["model"] == "terse:latest"  # echoed as given
        plain = chat(client, stream=False, options={"num_predict": 3}).json()
        assert answer["model"] == "terse" and answer["eval_count"] == 3 and answer["done_reason"] == "length"
        assert answer["prompt_eval_count"] > plain["prompt_eval_count"]  # its system prompt
        assert chat(client, model="terse", stream=False, options={"num_predict": 2}).json()["eval_count"] == 2
        own_system = [{"role": "system", "content": "x"}, *ASK]
        assert chat(client, model="terse", stream=False, messages=own_system).json()["prompt_eval_count"] < \
            answer["prompt_eval_count"]  # fmt: skip
        openai = client.post("/v1/chat/completions", json={"model": "terse", "messages": ASK}).json()
        assert openai["model"] == "terse" and openai["usage"]["completion_tokens"] == 3  # as Ollama's /v1 serves it
        assert openai["usage"]["prompt_tokens"] == answer["prompt_eval_count"]  # the same system prompt
        capped = {"model": "terse", "messages": ASK, "max_tokens": 2}
        assert client.post("/v1/chat/completions", json=capped).json()["usage"]["completion_tokens"] == 2
        generated = client.post("/api/generate", json={"model": "terse", "prompt": "hi", "stream": False}).json()
        assert generated["model"] == "terse" and generated["eval_count"] == 3
        shown = client.post("/api/show", json={"model": "terse"}).json()
        assert shown["modelfile"].startswith("FROM fake\nSYSTEM ") and "num_predict 3" in shown["parameters"]
        assert shown["system"] == "Answer in one word." and 'stop "zz"' in shown["parameters"]
        assert client.post("/api/copy", json={"source": "terse", "destination": "terse2"}).status_code == 200
        assert chat(client, model="terse2", stream=False).json()["eval_count"] == 3
        assert client.request("DELETE", "/api/delete", json={"model": "terse2"}).status_code == 200
        assert _made(client, "terse2") is None
        gone = chat(client, model="terse2", stream=False)
        assert gone.status_code == 404 and gone.json() == {"error": "model 'terse2' not found"}
    with fake_client(data_dir=tmp_path) as client:  # a restart over the same --data-dir
        assert (
            _made(client, "terse") is not None and chat(client, model="terse", stream=False).json()["eval_count"] == 3
        )


def test_an_older_client_s_modelfile_makes_the_same_model(tmp_path) -> None:
    modelfile = 'FROM fake\n# a comment\nPARAMETER num_predict 4\nPARAMETER stop "zz"\nSYSTEM """Be\nbrief."""\n'
    with fake_client(data_dir=tmp_path) as client:
        made = client.post("/api/create", json={"model": "old", "modelfile": modelfile, "stream": False})
        assert made.json() == {"status": "success"}
        shown = client.post("/api/show", json={"model": "old"}).json()
        assert shown["system"] == "Be\nbrief." and "num_predict 4" in shown["parameters"]
        assert chat(client, model="old", stream=False).json()["eval_count"] == 4


@pytest.mark.parametrize(("body", "status", "named"), [
    ({"model": "m", "from": "fake", "files": {"a.gguf": "sha256:00"}}, 400, "files"),
    ({"model": "m", "from": "fake", "quantize": "q4_K_M"}, 400, "quantize"),
    ({"model": "m", "from": "fake", "template": "{{ .Prompt }}"}, 400, "template"),
    ({"model": "m", "from": "fake", "colour": "blue"}, 400, "colour"),
    ({"model": "m", "from": "llama3.2"}, 404, "llama3.2"),
    ({"model": "m"}, 400, "from"),
    ({"model": "fake", "from": "fake"}, 400, "local file"),
    ({"model": "m", "from": "fake", "parameters": {"mirostat": 2}}, 400, "parameters.mirostat"),
    ({"model": "m", "from": "fake", "parameters": {"num_ctx": 10**6}}, 400, "parameters.num_ctx"),
    ({"model": "m", "modelfile": "FROM fake\nADAPTER ./lora.gguf"}, 400, "ADAPTER"),
    ({"model": "m", "from": "fake", "messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]"),
    ({"model": "m", "from": "fake", "system": "x" * 70_000}, 400, "at most 65536 bytes"),
])  # fmt: skip
def test_what_a_made_model_cannot_be_is_refused_naming_it(tmp_path, body: dict[str, Any], status: int,
                                                          named: str) -> None:  # fmt: skip
    with fake_client(data_dir=tmp_path) as client:
        response = client.post("/api/create", json=body)
        assert response.status_code == status and named in response.json()["error"]
        assert client.get("/api/tags").json()["models"][1:] == []  # nothing made
        served = client.request("DELETE", "/api/delete", json={"model": "fake"})
        assert served.status_code == 400 and "local file" in served.json()["error"]
