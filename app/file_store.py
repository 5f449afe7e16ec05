"""Uploaded files (OpenAI's Files API, the Batch API's input): each file's bytes under ``--data-dir``/files, its
metadata in an SQLite database there, so that both outlive a restart. Torch-free; SQLite from the standard library.

A file is written to a temporary name, then renamed, then recorded: a crash leaves no record of a half-written
file (a stray temporary file is removed at the next start)."""

from __future__ import annotations

import os
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from app.openai.errors import APIError, bad_request

#: What a file may be for: the Batch API's input, and files kept for the user's own use.
PURPOSES = ("batch", "user_data")
#: The most one upload may hold: OpenAI's limit on a batch's input file.
MAX_FILE_BYTES = 200 * 2**20
#: The database file under ``--data-dir`` (files, batches).
DATABASE = "smolserve.db"
#: ``GET /v1/files``'s page: at most this many (OpenAI's limit and default).
MAX_PAGE = 10_000
_SCHEMA = """CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, seq INTEGER NOT NULL)"""


def connect(data_dir: Path) -> sqlite3.Connection:
    """The server's one database under ``--data-dir`` (files, batches): WAL, autocommit, usable from any thread
    (each store serializes its own statements)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(data_dir / DATABASE, check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    return db


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/smolserve``, by default ``~/.local/share/smolserve``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "smolserve"


class FileStore:
    def __init__(self, data_dir: Path) -> None:
        self.folder = data_dir / "files"
        self.folder.mkdir(parents=True, exist_ok=True)
        for stray in self.folder.glob("*.partial"):
            stray.unlink()
        self._db = connect(data_dir)
        self._db.execute(_SCHEMA)
        self._lock = threading.Lock()

    def create(self, filename: str, purpose: str, content: bytes, internal: bool = False) -> dict[str, Any]:
        """A new file; ``internal``: one the server writes (a batch's output, purpose ``batch_output``)."""
        if purpose not in PURPOSES and not (internal and purpose == "batch_output"):
            raise bad_request(f"purpose: one of {', '.join(PURPOSES)} (this server has no {purpose!r} files)",
                              "purpose")  # fmt: skip
        file_id = f"file-{uuid.uuid4().hex[:24]}"
        partial = self.folder / f"{file_id}.partial"
        partial.write_bytes(content)
        partial.rename(self.folder / file_id)
        row = (file_id, filename, purpose, len(content), int(time.time()))
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", (*row, seq))
        return _file_object(row)

    def get(self, file_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._db.execute("SELECT id, filename, purpose, bytes, created_at FROM files WHERE id = ?",
                                   (file_id,)).fetchone()  # fmt: skip
        if row is None:
            raise APIError(404, f"No such File object: {file_id}", param="id", code="file_not_found")
        return _file_object(row)

    def path(self, file_id: str) -> Path:
        """Where a file's bytes are (a 404 for an unknown id)."""
        self.get(file_id)
        return self.folder / file_id

    def page(self, purpose: str | None, limit: int, after: str | None, order: str) -> dict[str, Any]:
        """OpenAI's list: newest first (``desc``) or oldest, ``limit`` of them after the file ``after``."""
        where, args = ["1 = 1"], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            with self._lock:
                found = self._db.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
            if found is None:
                raise bad_request(f"after: no file {after}", "after")
            where.append("seq < ?" if order == "desc" else "seq > ?")
            args.append(found[0])
        query = (f"SELECT id, filename, purpose, bytes, created_at FROM files WHERE {' AND '.join(where)} "
                 f"ORDER BY seq {'DESC' if order == 'desc' else 'ASC'} LIMIT ?")  # fmt: skip
        with self._lock:
            rows = self._db.execute(query, (*args, limit + 1)).fetchall()
        data = [_file_object(row) for row in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}  # fmt: skip

    def delete(self, file_id: str) -> dict[str, Any]:
        path = self.path(file_id)
        with self._lock:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
        path.unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def close(self) -> None:
        """After the statement in progress, if any (a batch's output written on a worker thread while the server
        stops): closing a connection another thread is using crashes the process."""
        with self._lock:
            self._db.close()


def _file_object(row: tuple[Any, ...]) -> dict[str, Any]:
    file_id, filename, purpose, size, created = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}  # fmt: skip
