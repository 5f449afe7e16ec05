"""OpenAI's Files API: ``POST /v1/files`` (multipart: ``file``, ``purpose``), ``GET /v1/files`` (``purpose``,
``limit``, ``after``, ``order``), ``GET /v1/files/{id}``, ``GET /v1/files/{id}/content``, ``DELETE /v1/files/{id}``;
kept by ``app/stores/file_store.py``. An upload is at most ``--max-file-bytes`` (413 beyond, decided before the body is
read). Torch-free."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response

from app.server.state import server_state
from app.stores.file_store import MAX_PAGE, FileStore
from app.stores.upload import receive_file
from app.wire.openai.errors import bad_request


def _store(request: Request) -> FileStore:
    return server_state(request).files


async def create_file(request: Request) -> Response:
    """The upload read as it arrives (``app/stores/upload.py``), at most ``--max-concurrent-uploads`` at once; the store
    opened and its writes made on the event loop in chunks (a chunk is at most the socket's read, 64 KiB)."""
    state = server_state(request)
    store = state.files
    with state.uploads:
        made = await receive_file(request.headers.get("content-type", ""), request.stream(), store,
                                  state.config.max_file_bytes)  # fmt: skip
    return JSONResponse(made)


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
