"""``POST /v1/completions``: the whole pipeline, from the body (``app/wire/openai/completions.py``) through the prompts'
token ids (or, with ``suffix``, the fill-in-the-middle prompt: ``app/api/infill.py``) to the generation and its answer.
Torch-free."""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response

from app.api import infill
from app.pipeline.chat_model import ChatModel
from app.server.limits import check_text
from app.server.state import ServerState, server_state
from app.wire.openai.completions import CompletionFormat, CompletionRequest, parse_completion_request

Prepared = tuple[ChatModel, CompletionRequest, list[list[int]], list[str] | None]


def prepare(state: ServerState, raw: bytes) -> Prepared:
    """On a worker: the model, the request, its prompts' token ids, and the texts to echo (``echo``)."""
    req = parse_completion_request(state.parse_body(raw))
    model = state.chat_model(req.model)
    for index, prompt in enumerate(req.prompts):
        if isinstance(prompt, str):
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{index}]"
            check_text([prompt], model.max_chars, model.max_model_len, param)
    if req.suffix is not None:
        return model, *infill.with_suffix(model, req)
    prompts = [model.prompt_ids(p) for p in req.prompts]
    echo_texts = None
    if req.echo:
        # Token prompts are echoed with their special tokens' text, so that logprobs' tokens join to it.
        decode = model.tokenizer.decode
        echo_texts = [p if isinstance(p, str) else decode(p, skip_special_tokens=False) for p in req.prompts]
    return model, req, prompts, echo_texts


async def completions(request: Request) -> Response:
    arrived = time.perf_counter()
    state = server_state(request)
    raw = await request.body()
    model, req, prompts, echo_texts = await state.prepare(lambda: prepare(state, raw), len(raw))
    fmt = CompletionFormat(model.tokenizer, prompts)
    return await state.respond(request, await model.generation(fmt, req.options, prompts, echo_texts, arrived))
