"""OpenAI's Batch API routes: ``POST /v1/batches`` (``input_file_id``, ``endpoint``, ``completion_window`` 24h,
``metadata``), ``GET /v1/batches`` (``limit``, ``after``), ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``.
The batches run in ``app/services/batch_runner.py``. Torch-free."""

from __future__ import annotations

import uuid

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.server.state import server_state
from app.services.batch_runner import ENDPOINTS, MAX_METADATA, BatchRunner, batch_object
from app.wire.openai.errors import bad_request


def runner(request: Request) -> BatchRunner:
    return server_state(request).batches


async def create_batch(request: Request) -> Response:
    state = server_state(request)
    body = state.parse_body(await request.body())
    unknown = sorted(set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"})
    if unknown:
        raise bad_request(f"{unknown[0]}: not a field of a batch", unknown[0])
    if body.get("endpoint") not in ENDPOINTS:
        raise bad_request(f"endpoint: one of {', '.join(ENDPOINTS)}", "endpoint")
    if body.get("completion_window") != "24h":
        raise bad_request("completion_window: 24h", "completion_window")
    metadata = body.get("metadata")
    _check_metadata(metadata)
    file_id = body.get("input_file_id")
    if not isinstance(file_id, str) or state.files.get(file_id)["purpose"] != "batch":
        raise bad_request("input_file_id: a file uploaded with purpose batch", "input_file_id")
    batch = batch_object(f"batch_{uuid.uuid4().hex[:24]}", file_id, body["endpoint"], metadata)
    state.batches.store.create(batch)
    state.batches.launch(batch["id"])
    return JSONResponse(batch)


def _check_metadata(metadata: object) -> None:
    """OpenAI's bounds: at most 16 keys, of at most 64 characters, each value a string of at most 512."""
    keys, key_chars, value_chars = MAX_METADATA
    if metadata is None:
        return
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad_request("metadata: an object of strings", "metadata")
    if len(metadata) > keys:
        raise bad_request(f"metadata has {len(metadata)} keys; at most {keys}", "metadata")
    for key, value in metadata.items():
        if len(key) > key_chars or len(value) > value_chars:
            raise bad_request(f"metadata: keys of at most {key_chars} characters, values of at most {value_chars}; "
                              f"{key[:20]!r} has {len(key)} and {len(value)}", f"metadata.{key[:64]}")  # fmt: skip


async def get_batch(request: Request) -> Response:
    return JSONResponse(runner(request).store.get(request.path_params["batch_id"]))


async def list_batches(request: Request) -> Response:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise bad_request("limit: an integer from 1 to 100", "limit")
    return JSONResponse(runner(request).store.page(int(raw), request.query_params.get("after")))


async def cancel_batch(request: Request) -> Response:
    return JSONResponse(runner(request).cancel(request.path_params["batch_id"]))
