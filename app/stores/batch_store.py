"""The Batch API's records (``app/api/batches.py``): each batch and each of its lines' results, in the SQLite database
beside the uploaded files (``app/stores/file_store.py``), so that a batch survives a restart: finished lines are kept
and the rest run once. Torch-free."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from app.stores.file_store import connect
from app.wire.openai.errors import APIError

_SCHEMA = (
    """CREATE TABLE IF NOT EXISTS batches (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, body TEXT NOT NULL)""",
    """CREATE TABLE IF NOT EXISTS batch_lines (batch_id TEXT NOT NULL, line INTEGER NOT NULL, ok INTEGER NOT NULL,
       result TEXT NOT NULL, PRIMARY KEY (batch_id, line))""",
)
#: A batch's finished lines: by line index, whether it went to the output file (else the error file), its line.
Results = dict[int, tuple[bool, dict[str, Any]]]
#: The statuses a batch leaves only by running on (a restart takes them up again).
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
#: Every status, as OpenAI's.
STATUSES = (*UNFINISHED, "completed", "failed", "expired", "cancelled")


class BatchStore:
    def __init__(self, data_dir: Path) -> None:
        self._db = connect(data_dir, _SCHEMA)
        self._lock = threading.Lock()

    def create(self, batch: dict[str, Any]) -> None:
        with self._lock:
            seq = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0]
            self._db.execute("INSERT INTO batches VALUES (?, ?, ?)", (batch["id"], seq, json.dumps(batch)))

    def save(self, batch: dict[str, Any]) -> None:
        with self._lock:
            self._db.execute("UPDATE batches SET body = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    def get(self, batch_id: str) -> dict[str, Any]:
        with self._lock:
            row = self._db.execute("SELECT body FROM batches WHERE id = ?", (batch_id,)).fetchone()
        if row is None:
            raise APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id", code="batch_not_found")
        return json.loads(row[0])

    def page(self, limit: int, after: str | None) -> dict[str, Any]:
        """Newest first, ``limit`` of them after the batch ``after``."""
        query, args = "SELECT body FROM batches", []
        if after is not None:
            query += " WHERE seq < (SELECT seq FROM batches WHERE id = ?)"
            args.append(after)
        with self._lock:
            rows = self._db.execute(f"{query} ORDER BY seq DESC LIMIT ?", (*args, limit + 1)).fetchall()
        data = [json.loads(row[0]) for row in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}  # fmt: skip

    def unfinished(self) -> list[dict[str, Any]]:
        with self._lock:
            rows = self._db.execute("SELECT body FROM batches ORDER BY seq").fetchall()
        return [batch for batch in (json.loads(row[0]) for row in rows) if batch["status"] in UNFINISHED]

    def tally(self) -> dict[str, tuple[int, int]]:
        """By status: how many batches, and how many of their validated lines have not finished."""
        query = """SELECT json_extract(body, '$.status'), COUNT(*), SUM(json_extract(body, '$.request_counts.total')
                   - json_extract(body, '$.request_counts.completed') - json_extract(body, '$.request_counts.failed'))
                   FROM batches GROUP BY 1"""
        with self._lock:
            rows = self._db.execute(query).fetchall()
        return {status: (count, pending or 0) for status, count, pending in rows}

    def record(self, batch_id: str, line: int, ok: bool, result: dict[str, Any]) -> None:
        """One line's result; a line recorded already (a restart raced its end) keeps its first."""
        self.record_many(batch_id, [(line, ok, result)])

    def record_many(self, batch_id: str, lines: list[tuple[int, bool, dict[str, Any]]]) -> None:
        """Lines' results (index, whether ok, the line), in one transaction."""
        rows = [(batch_id, line, int(ok), json.dumps(result)) for line, ok, result in lines]
        with self._lock:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR IGNORE INTO batch_lines VALUES (?, ?, ?, ?)", rows)
            self._db.execute("COMMIT")

    def results(self, batch_id: str) -> Results:
        with self._lock:
            rows = self._db.execute("SELECT line, ok, result FROM batch_lines WHERE batch_id = ?",
                                    (batch_id,)).fetchall()  # fmt: skip
        return {line: (bool(ok), json.loads(result)) for line, ok, result in rows}

    def close(self) -> None:
        """After the statement in progress, if any (as ``FileStore.close``)."""
        with self._lock:
            self._db.close()


def now() -> int:
    return int(time.time())
