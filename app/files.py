"""OpenAI's Files API: ``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files`` (``purpose``,
``limit``, ``after``, ``order``), ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
kept by ``app/file_store.py``. An upload is at most ``--max-file-bytes`` (413 beyond, decided before the body is
read). Torch-free."""

from __future__ import annotations

from starlette.datastructures import UploadFile
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from app.file_store import MAX_PAGE, FileStore
from app.openai.errors import bad_request
from app.state import server_state

#: The multipart fields an upload may carry (``expires_after`` is OpenAI's, for files that expire: not here).
FIELDS = {"file", "purpose"}


def _store(request: Request) -> FileStore:
    return server_state(request).files


async def create_file(request: Request) -> Response:
    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise bad_request("a file is uploaded as multipart/form-data with the fields file and purpose", "file")
    async with request.form(max_files=1, max_fields=8) as form:
        unknown = sorted(set(form) - FIELDS)
        if unknown:
            raise bad_request(f"{unknown[0]}: not a field of a file upload here", unknown[0])
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("file: required, a file part", "file")
        if not isinstance(purpose, str):
            raise bad_request("purpose: required", "purpose")
        content = await upload.read()
        name = upload.filename or "upload"
    state = server_state(request)
    return JSONResponse(await state.prepare(lambda: state.files.create(name, purpose, content), len(content)))


async def list_files(request: Request) -> Response:
    query = request.query_params
    raw_limit = query.get("limit", str(MAX_PAGE))
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= MAX_PAGE:
        raise bad_request(f"limit: an integer from 1 to {MAX_PAGE}", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order: asc or desc", "order")
    return JSONResponse(_store(request).page(query.get("purpose"), int(raw_limit), query.get("after"), order))


async def get_file(request: Request) -> Response:
    return JSONResponse(_store(request).get(request.path_params["file_id"]))


async def file_content(request: Request) -> Response:
    return FileResponse(_store(request).path(request.path_params["file_id"]), media_type="application/octet-stream")


async def delete_file(request: Request) -> Response:
    return JSONResponse(_store(request).delete(request.path_params["file_id"]))
