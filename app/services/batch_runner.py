"""The Batch API's runner (``app/api/batches.py`` has its routes): every unfinished batch carried out on the same
engine, one task each. Torch-free.

Validation reads every line of the input file first: a line that is not ``{"custom_id", "method": "POST", "url",
"body"}`` fails the whole batch (``errors`` name the lines). Each line then runs through the server's own endpoint
in process, so its output line holds exactly what that endpoint answers; its generation at a low ``priority``
(``BATCH_PRIORITY``: interactive requests are admitted first), at most ``IN_FLIGHT`` lines at once, and
while interactive requests generate, at most ``IN_FLIGHT_BESIDE`` lines of all batches (the steps stay small). A
line whose ``custom_id`` came before, whose ``url`` is not the batch's endpoint, that asks to stream, or whose body
the endpoint refuses goes to the error file. Each finished line is recorded at once (``app/stores/batch_store.py``): a
restart runs the rest, once. Cancel stops new lines at once; the finished ones are in the output."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx

from app.stores.batch_store import UNFINISHED, BatchStore, Results, now
from app.stores.file_store import FileStore
from app.wire.openai.errors import APIError

log = logging.getLogger(__name__)

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
#: Batch lines' ``priority`` (set by the server for a request with ``BATCH_HEADER``): after every interactive
#: request (vLLM's, lower first).
BATCH_PRIORITY = 1 << 20
#: Lines of one batch in the server at once.
IN_FLIGHT = 64
#: Lines of all batches in the server at once while interactive requests run (or ran in the last ``HOLD_S``): the
#: steps they share stay near an interactive stream's own size.
IN_FLIGHT_BESIDE = 1
#: The header that marks a request as a batch's line (its own requests do not hold the batch back).
BATCH_HEADER = "x-smolserve-batch"
WINDOW_S = 24 * 3600
#: Requests in one batch's input file (OpenAI's bound).
MAX_LINES = 50_000
#: ``metadata``: at most this many keys, each of at most this many characters, each value of at most this many
#: (OpenAI's bounds).
MAX_METADATA = (16, 64, 512)
#: The error lines of the lines a batch's end left unrun, by its last status (OpenAI's codes).
_UNRUN = {
    "cancelled": ("batch_cancelled", "The batch was cancelled before this request executed."),
    "expired": ("batch_expired", "This request could not be executed before the completion window expired."),
}
_STAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
           "cancelled_at")  # fmt: skip


#: The report of a server that has run no batch (``BatchRunner.report``).
NO_BATCHES: dict[str, Any] = {"by_status": {}, "lines_running": 0, "lines_waiting": 0,
                              "lines_finished": {"completed": 0, "failed": 0}}  # fmt: skip


def batch_object(batch_id: str, input_file_id: str, endpoint: str, metadata: dict[str, str] | None) -> dict[str, Any]:
    created = now()
    return {"id": batch_id, "object": "batch", "endpoint": endpoint, "errors": None, "input_file_id": input_file_id,
            "completion_window": "24h", "status": "validating", "output_file_id": None, "error_file_id": None,
            "created_at": created, "expires_at": created + WINDOW_S, **dict.fromkeys(_STAMPS),
            "request_counts": {"total": 0, "completed": 0, "failed": 0}, "metadata": metadata}  # fmt: skip


class BatchRunner:
    """Runs every unfinished batch, one task each, through ``app`` (this server's ASGI app)."""

    def __init__(self, store: BatchStore, files: Callable[[], FileStore], app: Any, api_key: str | None,
                 draining: Callable[[], bool] = lambda: False, interactive: Callable[[], bool] = lambda: False,
                 ) -> None:  # fmt: skip
        """``files``: the server's file store (opened on first use); ``app``: the server, which lines go through;
        ``draining``: whether the server is shutting down (no new lines; the batch resumes at the next start)."""
        self.store = store
        self._files = files
        self._draining = draining
        self._interactive = interactive
        self._flying = 0  # lines of every batch in the server now
        self._finished = {"completed": 0, "failed": 0}  # lines finished since the server started
        headers = {BATCH_HEADER: "1", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
        self._client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1",
                                         headers=headers, timeout=None)  # fmt: skip
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False  # the server stops: a batch's task cut short resumes at the next start

    async def start(self) -> None:
        for batch in self.store.unfinished():  # a restart: take them up again
            self.launch(batch["id"])

    async def stop(self) -> None:
        self._stopping = True
        for task in self._tasks.values():
            task.cancel()
        for task in list(self._tasks.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._client.aclose()
        self.store.close()

    def launch(self, batch_id: str) -> None:
        task = asyncio.ensure_future(self._guarded(batch_id))
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    async def _guarded(self, batch_id: str) -> None:
        """The batch run; a failure of the batch's own (its input file deleted, a full disk) fails it with the
        reason in ``errors``, where it would have stayed unfinished for ever (and failed again at each start)."""
        try:
            await self._run(batch_id)
        except Exception as exc:
            if self._stopping:
                return
            log.exception("batch %s failed", batch_id)
            code = exc.code if isinstance(exc, APIError) and exc.code else "server_error"
            batch = self.store.get(batch_id)
            batch["errors"] = {"object": "list", "data": [{"code": code, "message": str(exc), "line": None}]}
            self._move(batch, "failed")

    async def _run(self, batch_id: str) -> None:
        batch = self.store.get(batch_id)
        lines = await self._lines(batch)
        if lines is None:
            return
        done = self.store.results(batch_id)
        batch["request_counts"]["total"] = len(lines)
        if batch["status"] == "validating":
            self._move(batch, "in_progress")
        slots = asyncio.Semaphore(IN_FLIGHT)
        seen: set[str] = set()
        running = []
        for index, line in enumerate(lines):
            duplicate = line["custom_id"] in seen
            seen.add(line["custom_id"])
            if index in done:
                continue
            await slots.acquire()
            while self._interactive() and self._flying >= IN_FLIGHT_BESIDE and not self._draining():
                await asyncio.sleep(0.02)  # interactive requests first: the batch waits its turn
            if self._stopped(batch_id):
                slots.release()
                break
            self._flying += 1  # at launch: the loop launches without yielding while the gate is open
            running.append(asyncio.ensure_future(self._line(batch, index, line, duplicate, slots)))
        await asyncio.gather(*running)
        if not self._draining():  # else it resumes at the next start
            await self._finish(batch_id, lines)

    async def _lines(self, batch: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The input file's lines; None where the file is not a batch's (the batch failed, its errors named)."""
        path = self._files().path(batch["input_file_id"])
        lines, errors = await asyncio.to_thread(_read_lines, path)  # up to 200 MB: off the loop
        if errors or not lines:
            errors = errors or [{"code": "empty_file", "message": "the input file has no requests", "line": None}]
            batch["errors"] = {"object": "list", "data": errors}
            self._move(batch, "failed")
            return None
        return lines

    async def _line(self, batch: dict[str, Any], index: int, line: dict[str, Any], duplicate: bool,
                    slots: asyncio.Semaphore) -> None:  # fmt: skip
        """One line: answered, recorded, counted (the batch read again: a cancel may have changed it meanwhile)."""
        batch_id = batch["id"]
        try:
            try:
                answered = await self._answer(batch, line, duplicate)
            except Exception as exc:  # the line's failure, never the batch's
                answered = False, _error_line(line, {"code": "server_error", "message": str(exc)})
            if answered is None or (self._draining() and not answered[0]):
                return  # the batch stopped first, or a 503 of the shutdown: unrun (a restart runs it)
            ok, result = answered
            self.store.record(batch_id, index, ok, result)
            self._finished["completed" if ok else "failed"] += 1
            fresh = self.store.get(batch_id)
            fresh["request_counts"]["completed" if ok else "failed"] += 1
            self.store.save(fresh)
        finally:
            self._flying -= 1
            slots.release()

    async def _answer(self, batch: dict[str, Any], line: dict[str, Any], duplicate: bool,
                      ) -> tuple[bool, dict[str, Any]] | None:  # fmt: skip
        """One line's output line, and whether it goes to the output file (else the error file); None where the
        batch stopped (cancelled, draining, past its window) while the line waited for room."""
        refused = _refusal(batch["endpoint"], line, duplicate)
        if refused is not None:
            return False, _error_line(line, refused)
        answer = await self._post(batch["id"], line)
        if answer is None:
            return None
        try:
            answered = answer.json()
        except ValueError:
            answered = {"error": {"message": answer.text, "type": "server_error"}}
        response = {"status_code": answer.status_code, "request_id": answer.headers.get("x-request-id", ""),
                    "body": answered}  # fmt: skip
        entry = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"]}
        return answer.status_code == 200, {**entry, "response": response, "error": None}

    async def _post(self, batch_id: str, line: dict[str, Any]) -> httpx.Response | None:
        """The endpoint's answer to a line. A full queue (429) is waited out, ``Retry-After`` at a time: a line never
        fails for want of room (a batch has 24 hours). None where the batch stopped meanwhile."""
        while True:
            answer = await self._client.post(line["url"], json=line["body"])
            if answer.status_code != 429:
                return answer
            await asyncio.sleep(float(answer.headers.get("retry-after", "1")))
            if self._stopped(batch_id):
                return None

    def _stopped(self, batch_id: str) -> bool:
        """Whether no line of the batch starts now: it was cancelled, its window ended, or the server drains."""
        batch = self.store.get(batch_id)
        return batch["status"] != "in_progress" or now() > batch["expires_at"] or self._draining()

    async def _finish(self, batch_id: str, lines: list[dict[str, Any]]) -> None:
        """The output and error files from every finished line, in input order (a line a cancel or the window's end
        left unrun: an error line saying so); then the batch's last status."""
        batch = self.store.get(batch_id)
        results = self.store.results(batch_id)
        final = _final_status(batch, len(results) == len(lines))
        if final in _UNRUN:
            results = self._close_unrun(batch_id, lines, results, final)
        completed = sum(ok for ok, _ in results.values())
        batch["request_counts"] = {"total": len(lines), "completed": completed, "failed": len(results) - completed}
        self._move(batch, "finalizing")
        for ok, key in ((True, "output_file_id"), (False, "error_file_id")):
            name = f"{batch_id}_{'output' if ok else 'error'}.jsonl"
            batch[key] = await asyncio.to_thread(self._write, name, _jsonl(results, ok))
        self._move(batch, final)

    def _write(self, name: str, lines: Iterator[bytes]) -> str | None:
        """A batch's output or error file, written line by line as the lines are made; None if it has none."""
        files = self._files()
        with files.writing(files.max_bytes) as pending:
            for line in lines:
                pending.writer.write(line)
            if pending.writer.size:
                pending.keep(name, "batch_output", internal=True)
        return pending.made["id"] if pending.made else None

    def _close_unrun(self, batch_id: str, lines: list[dict[str, Any]], results: Results, final: str) -> Results:
        """Every line that never ran, recorded as failed with OpenAI's ``batch_cancelled`` or ``batch_expired``: each
        input line is in the output or the error file, and ``completed + failed == total``."""
        code, message = _UNRUN[final]
        unrun = [(index, False, _error_line(line, {"code": code, "message": message}))
                 for index, line in enumerate(lines) if index not in results]  # fmt: skip
        self.store.record_many(batch_id, unrun)  # one transaction: a cancelled batch may leave 50,000
        self._finished["failed"] += len(unrun)
        return self.store.results(batch_id)

    def _move(self, batch: dict[str, Any], status: str) -> None:
        batch["status"] = status
        batch[f"{status}_at"] = now()
        self.store.save(batch)

    def report(self) -> dict[str, Any]:
        """The batch queue, for ``/health`` and the metrics: batches by status, the lines of unfinished batches
        running now and waiting their turn, and the lines finished since the server started."""
        tally = self.store.tally()
        pending = sum(lines for status, (_, lines) in tally.items() if status in UNFINISHED)
        return {"by_status": {status: count for status, (count, _) in sorted(tally.items())},
                "lines_running": self._flying, "lines_waiting": max(pending - self._flying, 0),
                "lines_finished": dict(self._finished)}  # fmt: skip

    def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = self.store.get(batch_id)
        if batch["status"] not in UNFINISHED:
            raise APIError(409, f"Cannot cancel a batch with status '{batch['status']}'.", param="batch_id",
                           code="batch_not_cancellable")  # fmt: skip
        if batch["status"] in ("validating", "in_progress"):
            self._move(batch, "cancelling")
        return batch


def _jsonl(results: Results, ok: bool) -> Iterator[bytes]:
    """The lines that went to the output file (``ok``) or the error file, in input order, one at a time."""
    for index in sorted(results):
        if results[index][0] is ok:
            yield json.dumps(results[index][1]).encode() + b"\n"


def _error_line(line: dict[str, Any], error: dict[str, str]) -> dict[str, Any]:
    """A line's error-file line where the endpoint gave no answer (refused first, failed, or never run)."""
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": line["custom_id"], "response": None, "error": error}


def _final_status(batch: dict[str, Any], every_line_ran: bool) -> str:
    """How a batch whose lines stopped ends: cancelled when it was cancelled (a restart may find it finalizing),
    else completed, or expired where the window ended first."""
    if batch["status"] == "cancelling" or (batch["status"] == "finalizing" and batch["cancelling_at"]):
        return "cancelled"
    if batch["status"] in ("in_progress", "finalizing"):
        return "completed" if every_line_ran else "expired"
    return batch["status"]


def _read_lines(path: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each line as a request object, and an error for each line that is not one (1-based line numbers); read line
    by line, never whole, and no further than ``MAX_LINES`` requests."""
    lines, errors = [], []
    with path.open("rb") as file:
        for number, raw in enumerate(file, start=1):
            text = raw.decode("utf-8", errors="replace")
            if not text.strip():
                continue
            if len(lines) + len(errors) == MAX_LINES:
                return [], [{"code": "too_many_requests", "line": number, "message":
                             f"a batch holds at most {MAX_LINES} requests (OpenAI's bound)"}]  # fmt: skip
            _read_line(text, number, lines, errors)
    return lines, errors


def _read_line(text: str, number: int, lines: list[dict[str, Any]], errors: list[dict[str, Any]]) -> None:
    try:
        line = json.loads(text)
    except ValueError:
        line = None
    fields_ok = isinstance(line, dict) and isinstance(line.get("custom_id"), str) and isinstance(
        line.get("url"), str) and line.get("method") == "POST" and isinstance(line.get("body"), dict)  # fmt: skip
    if not fields_ok:
        errors.append({"code": "invalid_request", "line": number, "message":
                       'each line must be a JSON object {"custom_id": string, "method": "POST", "url": string, '
                       '"body": object}'})  # fmt: skip
        return
    lines.append(line)


def _refusal(endpoint: str, line: dict[str, Any], duplicate: bool) -> dict[str, str] | None:
    if duplicate:
        return {"code": "duplicate_custom_id", "message": f"custom_id {line['custom_id']!r} came before in the file"}
    if line["url"] != endpoint:
        return {"code": "invalid_url", "message": f"this batch's endpoint is {endpoint}, not {line['url']}"}
    if line["body"].get("stream"):
        return {"code": "invalid_request", "message": "a batch's requests cannot stream"}
    return None
