"""A multipart upload (``POST /v1/files``) read as it arrives: the file part written to the store chunk by chunk,
counted against ``--max-file-bytes`` and ``--max-data-bytes``, never held whole in memory; the few small fields
beside it kept. At most ``--max-concurrent-uploads`` at once (429 beyond). Torch-free; python-multipart parses."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

from app.stores.file_store import FileStore, FileWriter
from app.wire.openai.errors import APIError, bad_request

#: Bytes of one form field beside the file (``purpose``).
MAX_FIELD_BYTES = 256
#: The fields an upload may carry (``expires_after`` is OpenAI's, for files that expire: not here).
FIELDS = ("file", "purpose")


@dataclass(slots=True)
class _Part:
    name: str = ""
    value: bytearray = field(default_factory=bytearray)


class UploadGate:
    """Counts the uploads in progress; one past ``most`` is a 429 (each holds a connection and a file open)."""

    def __init__(self, most: int) -> None:
        self.most = most
        self._now = 0
        self._lock = threading.Lock()

    def __enter__(self) -> UploadGate:
        with self._lock:
            if self._now >= self.most:
                message = f"{self.most} uploads are in progress, the most this server receives at once; retry later"
                raise APIError(429, message, code="too_many_uploads", headers={"Retry-After": "1"})
            self._now += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self._now -= 1


class _Form:
    """The parser's callbacks: headers name each part; the file part's data goes to ``sink``, the others' to
    their values (bounded)."""

    def __init__(self, sink: FileWriter) -> None:
        self.fields: dict[str, str] = {}
        self.has_file = False
        self.filename = "upload"
        self._sink = sink
        self._part = _Part()
        self._header, self._headers = b"", {}  # the header being read, and the part's
        self._value = b""

    def callbacks(self) -> dict[str, Any]:
        return {"on_part_begin": self._begin, "on_part_data": self._data, "on_part_end": self._end,
                "on_header_field": self._header_field, "on_header_value": self._header_value,
                "on_header_end": self._header_end, "on_headers_finished": self._headers_finished}  # fmt: skip

    def _begin(self) -> None:
        self._part, self._headers = _Part(), {}

    def _header_field(self, data: bytes, start: int, end: int) -> None:
        self._header += data[start:end]

    def _header_value(self, data: bytes, start: int, end: int) -> None:
        self._value += data[start:end]

    def _header_end(self) -> None:
        self._headers[self._header.lower()] = self._value
        self._header, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if name not in FIELDS:
            raise bad_request(f"{name}: not a field of a file upload here", name or None)
        if name in self.fields or (name == "file" and self.has_file):
            raise bad_request(f"{name}: given twice", name)
        self._part.name = name
        if name == "file":
            filename = options.get(b"filename")
            self.filename = filename.decode("utf-8", "replace") if filename else "upload"
            self.has_file = True

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self._part.name == "file":
            self._sink.write(data[start:end])
            return
        self._part.value += data[start:end]
        if len(self._part.value) > MAX_FIELD_BYTES:
            raise bad_request(f"{self._part.name}: longer than {MAX_FIELD_BYTES} bytes", self._part.name)

    def _end(self) -> None:
        if self._part.name != "file":
            self.fields[self._part.name] = self._part.value.decode("utf-8", "replace")


async def receive_file(content_type: str, chunks: AsyncIterator[bytes], store: FileStore,
                       max_bytes: int) -> dict[str, Any]:  # fmt: skip
    """Reads a multipart upload from ``chunks`` into ``store``; the file object once recorded. The fields are
    checked when the form ends; a refused or broken upload leaves nothing behind."""
    media, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if media != b"multipart/form-data" or not boundary:
        raise bad_request("a file is uploaded as multipart/form-data with the fields file and purpose", "file")
    with store.writing(max_bytes) as pending:
        form = _Form(pending.writer)
        parser = MultipartParser(boundary, form.callbacks())
        try:
            async for chunk in chunks:
                parser.write(chunk)
            parser.finalize()
        except FormParserError as exc:
            raise bad_request(f"the multipart body is malformed: {exc}", "file") from None
        if not form.has_file:
            raise bad_request("file: required, a file part", "file")
        purpose = form.fields.get("purpose")
        if purpose is None:
            raise bad_request("purpose: required", "purpose")
        pending.keep(form.filename, purpose)
    assert pending.made is not None
    return pending.made
