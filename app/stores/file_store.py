"""Uploaded files (OpenAI's Files API, the Batch API's input): each file's bytes under ``--data-dir``/files, its
metadata in an SQLite database there, so that both outlive a restart. Torch-free; SQLite from the standard library.

A file is written to a temporary name as its bytes arrive (never held whole in memory), then renamed, then recorded:
a failure (the upload cut short, the disk full, ``--max-data-bytes`` reached) removes the temporary file at once, and
a crash leaves no record of a half-written file (stray temporary files, and files no record names, are removed at
the next start). All files together hold at most ``--max-data-bytes``; a write past it is refused, naming the
bound."""

from __future__ import annotations

import contextlib
import errno
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from app.wire.openai.errors import APIError, bad_request

#: What a file may be for: the Batch API's input, and files kept for the user's own use.
PURPOSES = ("batch", "user_data")
#: The most one upload may hold: OpenAI's limit on a batch's input file.
MAX_FILE_BYTES = 200 * 2**20
#: What all files under ``--data-dir`` may hold together, by default (uploads and batch outputs).
MAX_DATA_BYTES = 16 * 2**30
#: The database file under ``--data-dir`` (files, batches).
DATABASE = "smolserve.db"
#: ``GET /v1/files``'s page: at most this many (OpenAI's limit and default).
MAX_PAGE = 10_000
_SCHEMA = """CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, filename TEXT NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL,
    created_at INTEGER NOT NULL, seq INTEGER NOT NULL)"""


class StoreError(Exception):
    """The data directory cannot be used (a corrupt database, a folder that cannot be written): what and where, for
    the operator; a request meeting it is a 503 naming the file."""


def connect(data_dir: Path, schema: tuple[str, ...] = ()) -> sqlite3.Connection:
    """The server's one database under ``--data-dir`` (files, batches), its ``schema`` made: WAL, autocommit, usable
    from any thread (each store serializes its own statements). A ``StoreError`` naming the file if it is not a
    database SQLite can read."""
    path = data_dir / DATABASE
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        for statement in schema:
            db.execute(statement)
    except (sqlite3.DatabaseError, OSError) as exc:
        raise StoreError(f"the database {path} cannot be used ({exc}): move it away to start afresh, or give "
                         "another --data-dir") from None  # fmt: skip
    return db


def default_data_dir() -> Path:
    """``$XDG_DATA_HOME/smolserve``, by default ``~/.local/share/smolserve``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(base) / "smolserve"


class FileWriter:
    """One file being written: its bytes counted against the file's bound and the store's as they come."""

    def __init__(self, store: FileStore, handle: BinaryIO, max_bytes: int) -> None:
        self._store, self._handle, self._max = store, handle, max_bytes
        self.size = 0

    def write(self, chunk: bytes) -> None:
        if self.size + len(chunk) > self._max:
            raise APIError(413, f"the file has more than {self._max} bytes; this server accepts at most "
                           f"{self._max} (--max-file-bytes)", param="file", code="file_too_large")  # fmt: skip
        self._store.reserve(len(chunk))
        self.size += len(chunk)
        try:
            self._handle.write(chunk)
        except OSError as exc:
            raise _disk_error(exc, self._store.folder) from None


@dataclass(slots=True)
class PendingFile:
    """A file being written (``FileStore.writing``): its writer, then what to record it as."""

    id: str
    writer: FileWriter = field(init=False)
    kept: tuple[str, str] | None = None
    made: dict[str, Any] | None = None

    def keep(self, filename: str, purpose: str, internal: bool = False) -> None:
        """Keep the file under ``filename`` for ``purpose``; ``internal``: one the server writes (a batch's output,
        purpose ``batch_output``)."""
        if purpose not in PURPOSES and not (internal and purpose == "batch_output"):
            raise bad_request(f"purpose: one of {', '.join(PURPOSES)} (this server has no {purpose!r} files)",
                              "purpose")  # fmt: skip
        self.kept = (filename, purpose)


class FileStore:
    def __init__(self, data_dir: Path, max_bytes: int = MAX_DATA_BYTES) -> None:
        self.folder = data_dir / "files"
        self.max_bytes = max_bytes
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StoreError(f"the folder {self.folder} cannot be made ({exc})") from None
        self._db = connect(data_dir, (_SCHEMA,))
        self._lock = threading.Lock()
        self._used = self._clean()

    def _clean(self) -> int:
        """Removes what a crash or a full disk left (temporary files, files no record names, records of files that
        are gone); the bytes the files hold."""
        with self._lock:
            rows = dict(self._db.execute("SELECT id, bytes FROM files").fetchall())
        on_disk = {path.name: path for path in self.folder.iterdir()}
        for name, path in on_disk.items():
            if name not in rows:
                path.unlink(missing_ok=True)
        gone = [file_id for file_id in rows if file_id not in on_disk]
        with self._lock:
            self._db.executemany("DELETE FROM files WHERE id = ?", [(file_id,) for file_id in gone])
        return sum(size for file_id, size in rows.items() if file_id in on_disk)

    def reserve(self, size: int) -> None:
        """Counts ``size`` more bytes against ``--max-data-bytes`` (a 507 past it, nothing counted)."""
        with self._lock:
            if self._used + size > self.max_bytes:
                raise APIError(507, f"the files under {self.folder} would hold more than --max-data-bytes "
                               f"({self.max_bytes} bytes): delete files to make room", code="storage_full")  # fmt: skip
            self._used += size

    @property
    def used_bytes(self) -> int:
        return self._used

    @contextlib.contextmanager
    def writing(self, max_bytes: int) -> Iterator[PendingFile]:
        """A new file written chunk by chunk (``pending.writer``); kept and recorded when the block ends if
        ``pending.keep`` was called (``pending.made`` is then its file object), else removed, as it is if the block
        raises."""
        pending = PendingFile(f"file-{uuid.uuid4().hex[:24]}")
        partial = self.folder / f"{pending.id}.partial"
        try:
            with partial.open("wb") as handle:
                pending.writer = FileWriter(self, handle, max_bytes)
                yield pending
            if pending.kept is not None:
                partial.rename(self.folder / pending.id)
                pending.made = self._record(pending.id, *pending.kept, pending.writer.size)
                return
        except OSError as exc:
            self._discard(pending, partial)
            raise _disk_error(exc, self.folder) from None
        except BaseException:
            self._discard(pending, partial)
            raise
        self._discard(pending, partial)

    def _discard(self, pending: PendingFile, partial: Path) -> None:
        """A file not kept: its bytes removed (written or renamed already) and no longer counted."""
        partial.unlink(missing_ok=True)
        (self.folder / pending.id).unlink(missing_ok=True)
        writer = getattr(pending, "writer", None)  # None where the file could not even be opened
        with self._lock:
            self._used -= writer.size if writer is not None else 0

    def _record(self, file_id: str, filename: str, purpose: str, size: int) -> dict[str, Any]:
        row = (file_id, filename, purpose, size, int(time.time()))
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM files").fetchone()[0]
            self._db.execute("INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)", (*row, seq))
        return _file_object(row)

    def create(self, filename: str, purpose: str, content: bytes, internal: bool = False) -> dict[str, Any]:
        """A new file of ``content``."""
        with self.writing(len(content)) as pending:
            pending.writer.write(content)
            pending.keep(filename, purpose, internal)
        assert pending.made is not None
        return pending.made

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
        size = self.get(file_id)["bytes"]
        with self._lock:
            self._db.execute("DELETE FROM files WHERE id = ?", (file_id,))
            self._used -= size
        (self.folder / file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    def close(self) -> None:
        """After the statement in progress, if any (a batch's output written on a worker thread while the server
        stops): closing a connection another thread is using crashes the process."""
        with self._lock:
            self._db.close()


def _disk_error(exc: OSError, folder: Path) -> APIError:
    """A write that failed: the disk full is a 507 naming the folder; any other failure a 500 saying what."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return APIError(507, f"the disk under {folder} is full: the file was not kept", code="disk_full")
    return APIError(500, f"the file could not be written under {folder}: {exc.strerror}", code="write_failed")


def _file_object(row: tuple[Any, ...]) -> dict[str, Any]:
    file_id, filename, purpose, size, created = row
    return {"id": file_id, "object": "file", "bytes": size, "created_at": created, "filename": filename,
            "purpose": purpose, "status": "processed", "expires_at": None, "status_details": None}  # fmt: skip
