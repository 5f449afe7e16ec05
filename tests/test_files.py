"""OpenAI's Files API (``app/api/files.py``, ``app/stores/file_store.py``) through the openai SDK: upload, list
(purpose, order, pages), retrieve, content, delete; the files outlive the server (a new app over the same
``--data-dir``); the size limit (413), unknown purposes and fields (400), unknown ids (404)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from app_helpers import fake_client
from starlette.testclient import TestClient

LINES = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with fake_client(data_dir=tmp_path, max_file_bytes=4096) as client:
        yield client


@pytest.fixture
def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://127.0.0.1/v1", api_key="none", http_client=http, max_retries=0)


def test_upload_list_retrieve_content_and_delete(sdk: openai.OpenAI) -> None:
    first = sdk.files.create(file=("input.jsonl", LINES), purpose="batch")
    second = sdk.files.create(file=("notes.txt", "é ✓\n".encode()), purpose="user_data")
    assert first.id.startswith("file-") and (first.bytes, first.filename, first.purpose) == (len(LINES), "input.jsonl",
                                                                                            "batch")  # fmt: skip
    assert first.object == "file" and first.status == "processed" and first.created_at > 0
    assert [f.id for f in sdk.files.list()] == [second.id, first.id]  # newest first
    assert [f.id for f in sdk.files.list(purpose="batch")] == [first.id]
    assert [f.id for f in sdk.files.list(order="asc", limit=1)] == [first.id, second.id]  # the SDK follows pages
    assert sdk.files.retrieve(second.id).filename == "notes.txt"
    assert sdk.files.content(first.id).content == LINES and sdk.files.content(second.id).text == "é ✓\n"
    deleted = sdk.files.delete(first.id)
    assert deleted.deleted and deleted.id == first.id
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        sdk.files.content(first.id)


def test_files_outlive_the_server(tmp_path: Path) -> None:
    with fake_client(data_dir=tmp_path) as client:
        made = client.post("/v1/files", files={"file": ("in.jsonl", LINES)}, data={"purpose": "batch"}).json()
    with fake_client(data_dir=tmp_path) as client:
        assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [made["id"]]
        assert client.get(f"/v1/files/{made['id']}/content").content == LINES


def test_bad_uploads_are_refused(sdk: openai.OpenAI, http: TestClient) -> None:
    with pytest.raises(openai.APIStatusError) as too_large:
        sdk.files.create(file=("big.jsonl", b"x" * 5000), purpose="batch")
    assert too_large.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as purpose:
        sdk.files.create(file=("a.jsonl", LINES), purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"
    client = http
    extra = client.post("/v1/files", files={"file": ("a", LINES)}, data={"purpose": "batch", "colour": "red"})
    assert extra.status_code == 400 and extra.json()["error"]["param"] == "colour"
    missing = client.post("/v1/files", files={"purpose": (None, "batch")})
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "file"
    for not_multipart in (client.post("/v1/files", json={"purpose": "batch"}),
                          client.post("/v1/files", data={"purpose": "batch"})):  # a web page's form  # fmt: skip
        assert not_multipart.status_code == 415 and not_multipart.json()["error"]["code"] == "unsupported_media_type"
    for bad in ({"limit": "0"}, {"order": "up"}, {"after": "file-nope"}):
        assert client.get("/v1/files", params=bad).status_code == 400
    assert client.delete("/v1/files/file-nope").status_code == 404


def test_closing_the_store_waits_for_a_statement_in_progress(tmp_path: Path) -> None:
    """A batch's output is recorded on a worker thread; the server stopping meanwhile closes the store. Closing an
    SQLite connection another thread is using crashed the whole process (a segfault in CI): close waits for the
    statement, and a statement after it is a clean error."""
    import sqlite3
    import threading

    from app.stores.file_store import FileStore

    store = FileStore(tmp_path)
    closed = threading.Event()
    with store._lock:  # a statement in progress on another thread
        closer = threading.Thread(target=lambda: (store.close(), closed.set()))
        closer.start()
        assert not closed.wait(0.2)
    closer.join(5)
    assert closed.is_set()
    with pytest.raises(sqlite3.ProgrammingError):
        store.create("late.jsonl", "batch", b"{}\n")


def test_a_full_disk_is_a_507_and_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk filling mid-upload: a clear error naming the folder, the half-written file removed at once, the
    store's count of bytes as before; the next upload, with room again, is kept."""
    import errno

    from app.stores import file_store

    with fake_client(data_dir=tmp_path) as client:
        assert client.post("/v1/files", files={"file": ("a", LINES)}, data={"purpose": "batch"}).status_code == 200
        used = client.app.state.server.files.used_bytes
        real_write = file_store.FileWriter.write

        def full(self, chunk: bytes) -> None:
            real_write(self, chunk[:10])
            raise file_store._disk_error(OSError(errno.ENOSPC, "No space left on device"), tmp_path / "files")

        monkeypatch.setattr(file_store.FileWriter, "write", full)
        refused = client.post("/v1/files", files={"file": ("b", LINES * 100)}, data={"purpose": "batch"})
        assert refused.status_code == 507 and refused.json()["error"]["code"] == "disk_full"
        assert str(tmp_path / "files") in refused.json()["error"]["message"]
        assert len(list((tmp_path / "files").iterdir())) == 1  # the first file only, no .partial
        assert client.app.state.server.files.used_bytes == used
        monkeypatch.setattr(file_store.FileWriter, "write", real_write)
        assert client.post("/v1/files", files={"file": ("c", LINES)}, data={"purpose": "batch"}).status_code == 200


def test_strays_and_orphans_are_removed_at_start(tmp_path: Path) -> None:
    with fake_client(data_dir=tmp_path) as client:
        kept = client.post("/v1/files", files={"file": ("a", LINES)}, data={"purpose": "batch"}).json()
        gone = client.post("/v1/files", files={"file": ("b", LINES)}, data={"purpose": "batch"}).json()
    (tmp_path / "files" / "file-crashed.partial").write_bytes(b"half")
    (tmp_path / "files" / "file-unrecorded").write_bytes(b"orphan")
    (tmp_path / "files" / gone["id"]).unlink()  # a record whose bytes are gone
    with fake_client(data_dir=tmp_path) as client:
        assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [kept["id"]]
        assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [kept["id"]]
        assert client.app.state.server.files.used_bytes == len(LINES)


def test_a_corrupt_database_is_a_503_naming_the_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Not a traceback at start: the server starts, logs what is wrong, serves generations, and answers the file and
    batch routes with the file's name and what to do; nothing is deleted."""
    database = tmp_path / "smolserve.db"
    database.write_bytes(b"this is not an SQLite database" * 100)
    with caplog.at_level("ERROR"), fake_client(data_dir=tmp_path) as client:
        assert any(str(database) in record.getMessage() for record in caplog.records)
        upload = client.post("/v1/files", files={"file": ("a", LINES)}, data={"purpose": "batch"})
        for response in (client.get("/v1/files"), client.get("/v1/batches"), upload):
            assert response.status_code == 503, response.text
            error = response.json()["error"]
            assert error["code"] == "storage_unavailable" and str(database) in error["message"]
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert database.read_bytes().startswith(b"this is not")


def test_concurrent_first_uploads_open_one_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    import time

    from app.server import state as state_module

    opened: list[object] = []
    real = state_module.FileStore

    def slow_store(*args: object) -> object:
        time.sleep(0.2)  # two first requests meet while the first store is being opened
        opened.append(args)
        return real(*args)

    monkeypatch.setattr(state_module, "FileStore", slow_store)
    with fake_client(data_dir=tmp_path) as client:
        server = client.app.state.server
        threads = [threading.Thread(target=lambda: server.files) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert len(opened) == 1
