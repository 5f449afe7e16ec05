"""OpenAI's Batch API (``app/api/batches.py``, ``app/services/batch_runner.py``) through the openai SDK over the fake
engine: ``files.create`` → ``batches.create`` → poll → ``files.content``; each line's output exactly as the endpoint
answers it, the error file (a duplicate ``custom_id``, another url, a stream, a body the endpoint refuses), a malformed
file failing the batch with its lines named, cancel and the window's end (unrun lines in the error file), a restart in
the middle (in process, and ``python -m app`` killed with SIGTERM: the rest run once, none lost or repeated), the
batch's own errors, the queue on ``/metrics`` and ``/health``, and batches yielding to interactive requests."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from app_helpers import fake_client
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from app.services.batch_runner import batch_object
from app.stores.batch_store import BatchStore
from app.stores.file_store import FileStore
from engine.core.fake_engine import FakeEngine
from tests.app_helpers import LOCAL


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def chat_line(custom_id: str, max_tokens: int = 3, **extra: Any) -> dict[str, Any]:
    body = {"model": "fake", "messages": [{"role": "user", "content": f"hi {custom_id}"}], "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {**body, **extra}}


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with fake_client(FakeEngine(max_model_len=256), data_dir=tmp_path) as client:
        yield client


@pytest.fixture
def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)


def wait(sdk: openai.OpenAI, batch_id: str, seconds: float = 30) -> Any:
    deadline = time.monotonic() + seconds
    while (batch := sdk.batches.retrieve(batch_id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.05)
    return batch


def start_batch(http: TestClient, raw: bytes) -> dict[str, Any]:
    """Upload ``raw`` and start a chat batch over it: the batch as created."""
    upload = http.post("/v1/files", files={"file": ("in.jsonl", raw)}, data={"purpose": "batch"}).json()
    body = {"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return http.post("/v1/batches", json=body).json()


def lines_of(sdk: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [json.loads(line) for line in sdk.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_end_to_end_through_the_sdk(sdk: openai.OpenAI, http: TestClient) -> None:
    lines = [chat_line(f"req-{i}") for i in range(6)]
    lines += [chat_line("req-0"), {**chat_line("other"), "url": "/v1/completions"}, chat_line("streamed", stream=True),
              chat_line("refused", max_tokens=-1)]  # fmt: skip
    upload = sdk.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h",
                               metadata={"job": "t"})  # fmt: skip
    assert batch.id.startswith("batch_") and batch.status == "validating" and batch.metadata == {"job": "t"}
    done = wait(sdk, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at and done.finalizing_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (10, 6, 4)
    output, errors = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
    assert [line["custom_id"] for line in output] == [f"req-{i}" for i in range(6)]
    alone = http.post("/v1/chat/completions", json=lines[0]["body"]).json()
    first = output[0]["response"]
    assert first["status_code"] == 200 and first["body"]["choices"] == alone["choices"] and output[0]["error"] is None
    assert first["body"]["object"] == "chat.completion" and first["request_id"]
    codes = {line["custom_id"]: (line["error"] or {}).get("code") or line["response"]["status_code"] for line in errors}
    assert codes == {"req-0": "duplicate_custom_id", "other": "invalid_url", "streamed": "invalid_request",
                     "refused": 400}  # fmt: skip
    assert [b.id for b in sdk.batches.list()] == [batch.id]


@pytest.mark.parametrize(
    ("endpoint", "body", "read"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4}, lambda b: b["choices"][0]["text"]),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}, lambda b: b["output"][0]["content"][0]["text"]),
        ("/v1/embeddings", {"input": ["hi", "there"]}, lambda b: [d["embedding"] for d in b["data"]]),
    ],
)
def test_every_endpoint_s_lines_are_answered_as_it_answers(tmp_path: Path, endpoint: str, body: dict[str, Any],
                                                          read: Any) -> None:  # fmt: skip
    from app.server.app import create_app
    from app.server.state import ServerConfig
    from engine import chooser
    from engine.core.config import EngineConfig

    app = create_app(chooser.build(EngineConfig(model="fake")), ServerConfig(data_dir=tmp_path))
    with TestClient(app, base_url=LOCAL) as http:
        model = "fake-embedding" if "embed" in endpoint else "fake"
        lines = [{"custom_id": f"l{i}", "method": "POST", "url": endpoint, "body": {"model": model, **body}}
                 for i in range(2)]  # fmt: skip
        upload = http.post("/v1/files", files={"file": ("in.jsonl", jsonl(lines))}, data={"purpose": "batch"}).json()
        batch = http.post("/v1/batches", json={"input_file_id": upload["id"], "endpoint": endpoint,
                                               "completion_window": "24h"}).json()  # fmt: skip
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        done = wait(sdk, batch["id"])
        output = lines_of(sdk, done.output_file_id)
        alone = http.post(endpoint, json=lines[0]["body"]).json()
    assert done.status == "completed" and done.request_counts.completed == 2 and len(output) == 2
    assert read(output[0]["response"]["body"]) == read(alone) and output[0]["response"]["status_code"] == 200


_LINE_KINDS = st.sampled_from(["ok", "ok", "ok", "duplicate", "other_url", "stream", "refused", "not_json", "no_body"])


def test_every_line_of_any_file_is_answered_once_or_names_the_batch_s_failure(tmp_path: Path) -> None:
    """Random files (ids in any script, duplicates, other urls, streams, refused bodies, lines that are not
    requests): where every line is a request, each is in the output or the error file exactly once, the output in
    input order, ``completed + failed == total``; else the batch fails naming exactly the lines that are not."""
    with fake_client(FakeEngine(max_model_len=256), data_dir=tmp_path) as http:
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)

        @settings(max_examples=60, deadline=None)
        @given(st.lists(st.tuples(_LINE_KINDS, st.text(min_size=1, max_size=8)), min_size=1, max_size=12))
        def check(kinds: list[tuple[str, str]]) -> None:
            rows, seen, bad, answered = [], [], [], []
            for number, (kind, name) in enumerate(kinds, start=1):
                custom_id = seen[0] if kind == "duplicate" and seen else f"{name}-{number}"
                answered += [custom_id] if kind in ("ok", "duplicate") and custom_id not in seen else []
                line = chat_line(custom_id, 2)
                if kind == "other_url":
                    line["url"] = "/v1/completions"
                line["body"].update({"stream": True} if kind == "stream" else {"max_tokens": -1} if kind == "refused"
                                    else {})  # fmt: skip
                text = "{not json" if kind == "not_json" else json.dumps({**line, "body": None} if kind == "no_body"
                                                                          else line)  # fmt: skip
                bad += [number] if kind in ("not_json", "no_body") else []
                seen.append(custom_id)
                rows.append(text)
            done = wait(sdk, start_batch(http, ("\n".join(rows) + "\n").encode())["id"])
            if bad:
                assert done.status == "failed" and [error.line for error in done.errors.data] == bad
                return
            output, errors = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
            assert done.status == "completed" and done.request_counts.total == len(rows)
            assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors))
            assert sorted(line["custom_id"] for line in output + errors) == sorted(seen)
            assert [line["custom_id"] for line in output] == answered

        check()


def test_a_malformed_file_fails_the_batch_naming_its_lines(sdk: openai.OpenAI) -> None:
    raw = jsonl([chat_line("a")]) + b"not json\n" + b'{"custom_id": "b"}\n'
    upload = sdk.files.create(file=("bad.jsonl", raw), purpose="batch")
    batch = wait(sdk, sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions",
                                         completion_window="24h").id)  # fmt: skip
    assert batch.status == "failed" and batch.failed_at and [e.line for e in batch.errors.data] == [2, 3]


def test_cancel_stops_new_lines_and_keeps_the_finished_ones(tmp_path: Path) -> None:
    with fake_client(FakeEngine(max_model_len=256, step_delay=0.01), data_dir=tmp_path) as http:
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        upload = sdk.files.create(file=("in.jsonl", jsonl([chat_line(f"r{i}", 20) for i in range(200)])),
                                  purpose="batch")  # fmt: skip
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        while sdk.batches.retrieve(batch.id).request_counts.completed < 3:
            time.sleep(0.02)
        assert sdk.batches.cancel(batch.id).status == "cancelling"
        done = wait(sdk, batch.id)
        finished, unrun = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
        assert done.status == "cancelled" and done.cancelled_at and 3 <= len(finished) < 200
        assert len(finished) == done.request_counts.completed and len(unrun) == done.request_counts.failed
        assert {line["error"]["code"] for line in unrun} == {"batch_cancelled"}
        assert sorted(line["custom_id"] for line in finished + unrun) == sorted(f"r{i}" for i in range(200))
        with pytest.raises(openai.APIStatusError) as again:
            sdk.batches.cancel(batch.id)
        assert again.value.status_code == 409


def test_a_batch_past_its_window_expires_its_unrun_lines(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The completion window ends mid-batch (a 1-second window here, 24 hours served): no new line starts, the
    batch ends ``expired`` with the finished lines in the output and each other line a ``batch_expired`` error."""
    monkeypatch.setattr("app.services.batch_runner.WINDOW_S", 1)
    with fake_client(FakeEngine(max_model_len=256, step_delay=0.01), data_dir=tmp_path) as http:
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        upload = sdk.files.create(file=("in.jsonl", jsonl([chat_line(f"r{i}", 20) for i in range(300)])),
                                  purpose="batch")  # fmt: skip
        batch = sdk.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait(sdk, batch.id)
        output, errors = lines_of(sdk, done.output_file_id), lines_of(sdk, done.error_file_id)
    assert done.status == "expired" and done.expired_at and done.expired_at >= done.expires_at
    assert 0 < len(output) < 300 and {line["error"]["code"] for line in errors} == {"batch_expired"}
    assert (done.request_counts.completed, done.request_counts.failed) == (len(output), len(errors))
    assert sorted(line["custom_id"] for line in output + errors) == sorted(f"r{i}" for i in range(300))


def test_metrics_and_health_show_the_batch_queue(tmp_path: Path) -> None:
    with fake_client(FakeEngine(max_model_len=256, step_delay=0.01), data_dir=tmp_path) as http:
        idle = http.get("/health").json()["batches"]
        assert idle == {"by_status": {}, "lines_running": 0, "lines_waiting": 0,
                        "lines_finished": {"completed": 0, "failed": 0}}  # fmt: skip
        assert not (tmp_path / "smolserve.db").exists()  # reading the queue opened no database
        raw = jsonl([chat_line(f"r{i}", 20) for i in range(300)])
        batch = start_batch(http, raw)
        while (queue := http.get("/health").json()["batches"])["lines_finished"]["completed"] < 3:
            time.sleep(0.02)
        assert queue["by_status"] == {"in_progress": 1} and queue["lines_running"] > 0
        assert queue["lines_running"] + queue["lines_waiting"] + queue["lines_finished"]["completed"] >= 300
        text = http.get("/metrics").text
        assert (
            'smolserve:batches{status="in_progress"} 1.0' in text
            and 'smolserve:batches{status="completed"} 0.0' in text
        )
        running = float(re.search(r"^smolserve:batch_lines_running (\S+)$", text, re.M)[1])
        waiting = float(re.search(r"^smolserve:batch_lines_waiting (\S+)$", text, re.M)[1])
        assert running > 0 and waiting > 0
        http.post(f"/v1/batches/{batch['id']}/cancel")
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        done = wait(sdk, batch["id"])
        text = http.get("/metrics").text
    assert 'smolserve:batches{status="cancelled"} 1.0' in text and "smolserve:batch_lines_waiting 0.0" in text
    completed = re.search(r'^smolserve:batch_lines_total\{outcome="completed"\} (\S+)$', text, re.M)
    failed = re.search(r'^smolserve:batch_lines_total\{outcome="failed"\} (\S+)$', text, re.M)
    assert (float(completed[1]), float(failed[1])) == (done.request_counts.completed, done.request_counts.failed)


def test_a_restart_runs_the_rest_once(tmp_path: Path) -> None:
    """The server stops mid-batch; a new one over the same ``--data-dir`` resumes it: every line once."""
    lines = [chat_line(f"r{i}", 20) for i in range(120)]
    with fake_client(FakeEngine(max_model_len=256, step_delay=0.01), data_dir=tmp_path) as http:
        batch = start_batch(http, jsonl(lines))
        while http.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 5:
            time.sleep(0.02)
        http.app.state.server.draining = True  # as SIGTERM's drain: lines refused from now on are not failures
        time.sleep(0.3)
        assert http.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["failed"] == 0
    store = BatchStore(tmp_path)
    finished_before = len(store.results(batch["id"]))
    store.close()
    assert 5 <= finished_before < len(lines)
    with fake_client(FakeEngine(max_model_len=256), data_dir=tmp_path) as http:
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        done = wait(sdk, batch["id"])
        output = lines_of(sdk, done.output_file_id)
        ran = http.get("/metrics").text
    assert f'smolserve:model_requests_total{{model="fake"}} {float(len(lines) - finished_before)}' in ran
    assert done.status == "completed" and sorted(line["custom_id"] for line in output) == sorted(
        line["custom_id"] for line in lines)  # fmt: skip
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in lines]  # input order


def test_a_batch_whose_input_file_is_gone_fails_saying_so(tmp_path: Path) -> None:
    """The input file deleted before the batch ran (here: between a stop and the next start): the batch fails with
    the reason in ``errors``, instead of staying unfinished and failing again at every start."""
    files = FileStore(tmp_path)
    upload = files.create("in.jsonl", "batch", jsonl([chat_line("a")]))
    store = BatchStore(tmp_path)
    store.create(batch_object("batch_orphan", upload["id"], "/v1/chat/completions", None))
    store.close()
    files.delete(upload["id"])
    files.close()
    with fake_client(FakeEngine(max_model_len=256), data_dir=tmp_path) as http:
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        done = wait(sdk, "batch_orphan")
    assert done.status == "failed" and done.failed_at and done.errors.data[0].code == "file_not_found"


def test_a_full_queue_is_waited_out_not_a_failed_line(tmp_path: Path) -> None:
    """A server whose waiting queue holds 4 (``--max-queue``) answers most of a batch's 64 lines in flight 429: the
    lines wait their turn and all complete (they failed with 429 in the error file)."""
    with fake_client(FakeEngine(capacity=2, max_model_len=256, step_delay=0.002), data_dir=tmp_path,
                     max_queue=4) as http:  # fmt: skip
        batch = start_batch(http, jsonl([chat_line(f"r{i}", 5) for i in range(100)]))
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        done = wait(sdk, batch["id"], 60)
    assert (done.status, done.request_counts.completed, done.request_counts.failed) == ("completed", 100, 0)


def test_batch_requests_are_checked(http: TestClient) -> None:
    upload = http.post("/v1/files", files={"file": ("in.jsonl", jsonl([chat_line("a")]))},
                       data={"purpose": "user_data"}).json()  # fmt: skip
    base = {"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    for bad, param in (
        ({"endpoint": "/v1/messages"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({}, "input_file_id"),
        ({"colour": "red"}, "colour"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata." + "k" * 64),
        ({"metadata": {"note": "v" * 513}}, "metadata.note"),
    ):
        refused = http.post("/v1/batches", json={**base, **bad})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    assert http.post("/v1/batches", json={**base, "input_file_id": "file-nope"}).status_code == 404
    assert http.get("/v1/batches/batch_nope").status_code == 404


def test_a_file_of_more_than_50000_requests_fails_the_batch(sdk: openai.OpenAI, http: TestClient) -> None:
    """OpenAI's bound: the input file is read line by line and no further than 50,000 requests; none runs."""
    line = json.dumps(chat_line("x")).encode() + b"\n"
    batch = start_batch(http, line * 50_001)
    done = wait(sdk, batch["id"], 120)
    assert done.status == "failed" and done.errors.data[0].code == "too_many_requests"
    assert done.errors.data[0].line == 50_001 and done.request_counts.completed == 0


def test_the_output_file_is_written_line_by_line_in_input_order(sdk: openai.OpenAI, http: TestClient) -> None:
    batch = start_batch(http, jsonl([chat_line(f"r{i}") for i in range(30)] + [chat_line("r0")]))
    done = wait(sdk, batch["id"])
    assert [line["custom_id"] for line in lines_of(sdk, done.output_file_id)] == [f"r{i}" for i in range(30)]
    assert [line["custom_id"] for line in lines_of(sdk, done.error_file_id)] == ["r0"]
    assert sdk.files.retrieve(done.output_file_id).bytes == len(sdk.files.content(done.output_file_id).content)


def test_an_interactive_request_is_admitted_before_the_batch_s_waiting_lines(tmp_path: Path) -> None:
    """Batch lines wait at a low priority: an interactive request sent while 4 lines run and 28 wait is admitted
    as soon as one slot frees (first in FIFO order, it would wait for those 28 to be admitted)."""
    with fake_client(FakeEngine(capacity=4, max_model_len=256, step_delay=0.005), data_dir=tmp_path) as http:
        raw = jsonl([chat_line(f"r{i}", 12) for i in range(80)])
        batch = start_batch(http, raw)

        def completed() -> int:
            return http.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"]

        while completed() < 2:
            time.sleep(0.01)
        before = completed()
        answer = http.post("/v1/chat/completions", json=chat_line("interactive")["body"])
        assert answer.status_code == 200
        assert completed() - before < 16
        http.post(f"/v1/batches/{batch['id']}/cancel")


def test_an_interactive_request_parks_batch_lines_holding_every_slot(tmp_path: Path) -> None:
    """Long batch lines hold all four slots: an interactive request does not wait for one to end; it parks one
    (which resumes later, its output whole) and is answered before any line finishes."""
    with fake_client(FakeEngine(capacity=4, max_model_len=1024, step_delay=0.005), data_dir=tmp_path) as http:
        scheduler = http.app.state.server.backend.scheduler
        raw = jsonl([chat_line(f"r{i}", 300) for i in range(6)])
        batch = start_batch(http, raw)
        while scheduler.num_running < 4:
            time.sleep(0.01)
        answer = http.post("/v1/chat/completions", json=chat_line("interactive", 3)["body"])
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["content"] == "abc"
        assert http.get(f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 0
        sdk = openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)
        output = lines_of(sdk, wait(sdk, batch["id"]).output_file_id)
    assert scheduler.engine.planner.num_preemptions >= 1
    assert all(line["response"]["body"]["usage"]["completion_tokens"] == 300 for line in output) and len(output) == 6


def test_a_batch_yields_the_engine_while_interactive_requests_generate(tmp_path: Path) -> None:
    """While an interactive stream generates, no new batch line starts while one runs: the engine's batch shrinks to
    the stream and one line (without the rule the batch keeps 64 lines in the server)."""
    import threading

    with fake_client(FakeEngine(capacity=8, max_model_len=4096, step_delay=0.002), data_dir=tmp_path) as http:
        scheduler = http.app.state.server.backend.scheduler
        raw = jsonl([chat_line(f"r{i}", 12) for i in range(3000)])
        batch = start_batch(http, raw)
        while scheduler.num_running + scheduler.num_waiting < 32:
            time.sleep(0.01)
        streaming = threading.Event()

        def interactive() -> None:
            body = {**chat_line("interactive", 3000)["body"], "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    if streaming.is_set():
                        return

        thread = threading.Thread(target=interactive)
        thread.start()
        deadline = time.monotonic() + 20
        while scheduler.num_running + scheduler.num_waiting > 2:  # the stream and one batch line
            assert time.monotonic() < deadline, (scheduler.num_running, scheduler.num_waiting)
            time.sleep(0.01)
        streaming.set()
        thread.join()
        http.post(f"/v1/batches/{batch['id']}/cancel")


def test_a_batch_started_beside_an_interactive_stream_keeps_to_one_line(tmp_path: Path) -> None:
    """A batch created while an interactive stream generates sends one line at a time from its first: the engine
    never holds more than the stream and one line (lines counted from their launch, not from when they first run,
    or the launching loop sends 64 before any counts)."""
    import threading

    with fake_client(FakeEngine(capacity=8, max_model_len=4096, step_delay=0.005), data_dir=tmp_path) as http:
        scheduler = http.app.state.server.backend.scheduler
        streaming, done = threading.Event(), threading.Event()

        def interactive() -> None:
            body = {**chat_line("interactive", 3000)["body"], "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as response:
                for _ in response.iter_lines():
                    streaming.set()
                    if done.is_set():
                        return

        thread = threading.Thread(target=interactive)
        thread.start()
        assert streaming.wait(10)
        raw = jsonl([chat_line(f"r{i}", 12) for i in range(200)])
        batch = start_batch(http, raw)
        most, started = 0, time.monotonic()
        while http.get("/health").json()["batches"]["lines_finished"]["completed"] < 5:
            assert time.monotonic() - started < 20
            most = max(most, scheduler.num_running + scheduler.num_waiting)
            time.sleep(0.005)
        done.set()
        thread.join()
        http.post(f"/v1/batches/{batch['id']}/cancel")
    assert most <= 2


def test_kill_term_mid_batch_then_start_again_completes_it_once(tmp_path: Path) -> None:
    """``python -m app`` over a ``--data-dir`` gets SIGTERM mid-batch: it drains and exits 0 with the batch in
    progress; started again, it runs the rest: the output holds every line once, in input order, and the engine ran
    exactly the lines that had not finished."""
    lines = [chat_line(f"r{i}", 200) for i in range(400)]
    server, base = _start_server(tmp_path)
    try:
        upload = httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", jsonl(lines))},
                            data={"purpose": "batch"}).json()  # fmt: skip
        batch = httpx.post(f"{base}/v1/batches", json={"input_file_id": upload["id"], "completion_window": "24h",
                                                        "endpoint": "/v1/chat/completions"}).json()  # fmt: skip
        while httpx.get(f"{base}/v1/batches/{batch['id']}").json()["request_counts"]["completed"] < 40:
            time.sleep(0.05)
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    store = BatchStore(tmp_path)
    finished_before, status = len(store.results(batch["id"])), store.get(batch["id"])["status"]
    store.close()
    assert status == "in_progress" and 40 <= finished_before < len(lines)
    server, base = _start_server(tmp_path)
    try:
        deadline = time.monotonic() + 120
        while (done := httpx.get(f"{base}/v1/batches/{batch['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.1)
        content = httpx.get(f"{base}/v1/files/{done['output_file_id']}/content").text
        output = [json.loads(line) for line in content.splitlines()]
        ran = httpx.get(f"{base}/metrics").text
    finally:
        server.send_signal(signal.SIGTERM)
        assert server.wait(60) == 0
    assert [line["custom_id"] for line in output] == [line["custom_id"] for line in lines]
    assert done["request_counts"] == {"total": 400, "completed": 400, "failed": 0} and done["error_file_id"] is None
    assert f'smolserve:model_requests_total{{model="fake"}} {float(len(lines) - finished_before)}' in ran


def _start_server(data_dir: Path) -> tuple[subprocess.Popen[bytes], str]:
    """``python -m app`` on the fake engine (4 sequences a step, so that a batch takes a few seconds), its log in a
    file (a pipe nobody reads would fill and block it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "app", "--model", "fake", "--port", str(port), "--data-dir", str(data_dir),
               "--max-batch-size", "4"]  # fmt: skip
    with (data_dir / "server.log").open("ab") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    base, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 60
    while True:
        try:
            httpx.get(f"{base}/health", timeout=1)
            return server, base
        except httpx.HTTPError:
            assert server.poll() is None and time.monotonic() < deadline, (data_dir / "server.log").read_text()
            time.sleep(0.1)
