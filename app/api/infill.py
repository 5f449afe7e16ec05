"""Fill-in-the-middle: ``suffix`` on ``/v1/completions`` and llama.cpp's ``POST /infill``, for models whose
vocabulary has FIM tokens (``engine/core/fim.py``: the prompt in the family's order, the end-of-middle tokens).

``/infill`` is llama.cpp's server's endpoint as coding assistants call it (llama.vscode, llama.vim): ``input_prefix``,
``input_suffix``, ``input_extra`` (other files' ``{"filename", "text"}``, before the FIM prefix), ``prompt`` (the gap's
line up to the cursor), ``n_predict``, ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``,
``stream``, ``n_indent`` (stop at a line indented less) and ``t_max_predict_ms`` (stop at a newline once generating
took longer), with llama.cpp's defaults; its answer is llama.cpp's ``/completion`` object (``content``, ``stop_type``,
``tokens_predicted``, ``timings``, ...), streamed as one such object per event. ``cache_prompt`` (the prefix cache is
always on), ``t_max_prompt_ms`` (llama.cpp does not implement it either) and ``samplers`` naming samplers this server
runs (always in its one order: top-k, top-p, min-p, temperature) are accepted; any other field is a 400 naming it.
The prefix, suffix and extra context are cut to the context as llama.cpp cuts them (the prefix's end, the suffix's
start, then the extra context's end). Torch-free.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from app.pipeline.chat_model import ChatModel
from app.pipeline.generation import Generation
from app.pipeline.reply_budget import infill_default
from app.server.limits import check_text
from app.server.state import ServerState
from app.wire.openai.completions import CompletionRequest, parse_completion_request
from app.wire.openai.errors import APIError, bad_request
from app.wire.openai.request import parse_model
from engine.core import fim
from engine.core.streams import EngineError

#: llama.cpp's sampling defaults (its ``/completion``), where the request names none.
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
#: ``/infill`` fields that map onto a completion's sampling (llama.cpp's name: ours).
SAMPLING = {"temperature": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p", "seed": "seed",
            "stop": "stop", "stream": "stream", "repeat_penalty": "repetition_penalty",
            "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
            "ignore_eos": "ignore_eos"}  # fmt: skip
ACCEPTED = {"input_prefix", "input_suffix", "input_extra", "prompt", "n_predict", "model", "cache_prompt",
            "t_max_prompt_ms", "samplers", "n_indent", "t_max_predict_ms", *SAMPLING}  # fmt: skip
#: llama.cpp's sampler names this server runs.
SAMPLERS = {"top_k", "top_p", "min_p", "temperature", "infill"}


def with_suffix(model: ChatModel, req: CompletionRequest) -> tuple[CompletionRequest, list[list[int]], None]:
    """A completion with ``suffix``: its prompts as fill-in-the-middle prompts (each prompt the text before the
    gap), its sequences ending at the model's end-of-middle tokens."""
    fim_tokens = _fim(model, "suffix")
    prompts = []
    for prompt in req.prompts:
        if not isinstance(prompt, str):
            raise bad_request("suffix (fill-in-the-middle) needs a text prompt, not token ids", "prompt")
        prompts.append(_layout(model, fim.Infill(prompt, req.suffix or ""), "suffix"))
    return _ending_the_middle(req, fim_tokens), prompts, None


def fill_prompt(model: ChatModel, prefix: str, suffix: str, param: str) -> tuple[list[int], frozenset[int]]:
    """A fill-in-the-middle prompt of the text before and after the gap (``suffix``'s plain layout), and the tokens
    that end the middle; a 400 naming ``param`` for a model without FIM tokens."""
    fim_tokens = _fim(model, param)
    return _layout(model, fim.Infill(prefix, suffix), param), fim_tokens.ends


def _ending_the_middle(req: CompletionRequest, fim_tokens: fim.Fim) -> CompletionRequest:
    """``req`` whose sequences also stop at the model's end-of-middle tokens."""
    stops = req.options.stop_token_ids | fim_tokens.ends
    return dataclasses.replace(req, options=dataclasses.replace(req.options, stop_token_ids=stops))


def _fim(model: ChatModel, param: str) -> fim.Fim:
    found = model.tokenizer.fim
    if found is None:
        raise bad_request(
            f"{param} (fill-in-the-middle) needs a model whose vocabulary has FIM tokens (Qwen2.5-Coder's "
            f"<|fim_prefix|>, StarCoder's <fim_prefix>, CodeLlama's <PRE>, ...); {model.name}'s has none",
            param,
        )
    return found


def _layout(model: ChatModel, infill: fim.Infill, param: str, room: int | None = None) -> list[int]:
    """The prompt: ``/infill``'s (``room`` given) with llama.cpp's repository header, ``suffix``'s plain."""
    texts = [infill.prefix, infill.suffix, infill.prompt, *(text for _, text in infill.extra)]
    check_text(texts, model.max_chars, model.max_model_len, param)  # more than any cut could keep: not tokenized
    tokenizer = model.tokenizer
    assert tokenizer.fim is not None
    encode = lambda text: tokenizer.encode(text, False)  # noqa: E731
    return fim.layout(tokenizer.fim, encode, infill, tokenizer.start_ids, room, repository=room is not None)


@dataclass(slots=True, frozen=True)
class InfillRequest:
    completion: CompletionRequest
    prompt_text: str
    n_indent: int
    t_max_predict_ms: float
    #: 0: the prompt is only processed (into the prefix cache: llama.vscode's warm-up), nothing is answered
    n_predict: int = -1


def prepare(state: ServerState, raw: bytes) -> tuple[ChatModel, InfillRequest, list[int]]:
    """On a worker: the model, ``/infill``'s request and its prompt, cut to the context."""
    body = state.parse_body(raw)
    unknown = sorted(set(body) - ACCEPTED)
    if unknown:
        raise bad_request(f"{unknown[0]} is not supported by this server's /infill", unknown[0])
    model = state.chat_model(parse_model(body))
    fim_tokens = _fim(model, "input_prefix")
    infill = fim.Infill(_text(body, "input_prefix", True), _text(body, "input_suffix", True), _text(body, "prompt"),
                        _extra(body.get("input_extra")))  # fmt: skip
    _samplers(body.get("samplers"))
    req = _completion(model, body)
    budget = model.max_model_len - (req.options.max_tokens or 0)
    if budget < 8:
        raise bad_request(f"n_predict leaves no room for a prompt in {model.max_model_len} tokens", "n_predict")
    prompt = _layout(model, infill, "input_prefix", budget)
    req = _ending_the_middle(req, fim_tokens)
    n_indent, limit = _number(body, "n_indent"), _number(body, "t_max_predict_ms")
    text = model.tokenizer.decode(prompt, False)
    return model, InfillRequest(req, text, int(n_indent), limit, body.get("n_predict", -1)), prompt


def _completion(model: ChatModel, body: dict[str, Any]) -> CompletionRequest:
    """The sampling fields as a completion's, with llama.cpp's defaults; ``n_predict`` -1 (its default): up to
    the context, keeping room for the prompt."""
    fields = {ours: body[theirs] for theirs, ours in SAMPLING.items() if theirs in body}
    n_predict = body.get("n_predict", -1)
    if isinstance(n_predict, bool) or not isinstance(n_predict, int) or n_predict < -1:
        raise bad_request("n_predict must be an integer, -1 for no limit", "n_predict")
    # n_predict 0 runs one token nobody sees: the prompt is processed and cached, as llama.cpp does
    max_tokens = max(n_predict, 1) if n_predict >= 0 else infill_default(model.max_model_len)
    completion = {**DEFAULTS, **fields, "prompt": "-", "max_tokens": max_tokens, "model": body.get("model")}
    if fields.get("top_k") == 0:
        completion["top_k"] = -1  # llama.cpp's 0: off
    return parse_completion_request(completion)


def _text(body: dict[str, Any], name: str, required: bool = False) -> str:
    value = body.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise bad_request(f'"{name}" is required and must be a string' if required else f'"{name}" must be a string',
                          name)  # fmt: skip
    return value


def _extra(chunks: Any) -> list[tuple[str, str]]:
    if chunks is None:
        return []
    if not isinstance(chunks, list) or not all(isinstance(c, dict) for c in chunks):
        raise bad_request('"input_extra" must be an array of {"filename": string, "text": string}', "input_extra")
    extra = []
    for chunk in chunks:
        text, filename = chunk.get("text"), chunk.get("filename", "tmp")
        if not isinstance(text, str) or not isinstance(filename, str):
            raise bad_request('each "input_extra" chunk needs a string "text" (and "filename")', "input_extra")
        extra.append((filename, text))
    return extra


def _samplers(samplers: Any) -> None:
    if samplers is None:
        return
    names = samplers if isinstance(samplers, list) else None
    if names is None or not all(isinstance(n, str) for n in names) or set(names) - SAMPLERS:
        raise bad_request(f"samplers may name only {', '.join(sorted(SAMPLERS))} (run in that fixed order)",
                          "samplers")  # fmt: skip


def _number(body: dict[str, Any], name: str) -> float:
    value = body.get(name, 0)
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise bad_request(f"{name} must be a non-negative number", name)
    return float(value)


class Cutter:
    """llama.cpp's two stops for code completion over the text as it comes: ``n_indent`` (once a line break has
    come, a line indented by fewer blanks ends the text where its indentation ends) and ``t_max_predict_ms`` (at a
    token with a line break, once generating has taken longer). ``feed`` returns what may be sent."""

    def __init__(self, n_indent: int, t_max_predict_ms: float, clock: Any = time.perf_counter) -> None:
        self.n_indent, self.limit_s, self.clock = n_indent, t_max_predict_ms / 1000, clock
        self.started: float | None = None
        self.held = ""  # a line's indentation so far, while it is not known to be deep enough
        self.checking = False  # after a line break: the line's indentation is not known yet
        self.stopped = False

    def feed(self, piece: str) -> str:
        if self.started is None:
            self.started = self.clock()
        out = []
        for char in piece:
            if self.stopped:
                break
            out.append(self._char(char))
        if "\n" in piece and self.limit_s and self.clock() - self.started > self.limit_s:
            self.stopped = True
        return "".join(out)

    def _char(self, char: str) -> str:
        if not self.checking:
            if char == "\n" and self.n_indent:
                self.checking = True
            return char
        if char in " \t":
            self.held += char
            return ""
        released, self.held = self.held, ""
        if char == "\n":
            return released + char
        self.checking = False
        if len(released) < self.n_indent:
            self.stopped = True
            return released
        return released + char


async def answer(req: InfillRequest, generation: Generation) -> dict[str, Any]:
    """The whole answer: llama.cpp's ``/completion`` object."""
    result = _Result(req, generation)
    async for _ in result.pieces():
        pass
    return result.final()


async def events(req: InfillRequest, generation: Generation) -> AsyncIterator[str]:
    """One llama.cpp object per piece of text, ``stop`` false, then the final one (no ``[DONE]``, as llama.cpp)."""
    result = _Result(req, generation)
    try:
        async for piece, tokens in result.pieces():
            yield json.dumps({"index": 0, "content": piece, "tokens": tokens, "stop": False, "id_slot": 0,
                              "tokens_predicted": result.predicted, "tokens_evaluated": result.evaluated},
                             ensure_ascii=False)  # fmt: skip
    except APIError as exc:
        yield json.dumps(exc.body())
        return
    yield json.dumps(result.final(), ensure_ascii=False)


@dataclass(slots=True)
class _Result:
    req: InfillRequest
    generation: Generation
    content: str = ""
    predicted: int = 0
    stop_type: str = "none"
    first_token_at: float | None = None
    ended_at: float | None = None

    @property
    def evaluated(self) -> int:
        return self.generation.num_prompt_tokens

    async def pieces(self) -> AsyncIterator[tuple[str, list[int]]]:
        cutter = Cutter(self.req.n_indent, self.req.t_max_predict_ms)
        deltas = self.generation.deltas()
        try:
            async for _, delta in deltas:
                if isinstance(delta, EngineError):
                    raise APIError(500, str(delta), code="engine_error")
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                if self.req.n_predict == 0:
                    self.stop_type = "limit"
                    continue
                self.predicted += len(delta.token_ids)
                piece = cutter.feed(delta.text)
                self.content += piece
                if piece or delta.token_ids:
                    yield piece, list(delta.token_ids)
                if cutter.stopped:
                    self.stop_type = "limit"
                    break
                if delta.finish_reason is not None:
                    self.stop_type = self._stop_type(delta.finish_reason, delta.token_ids)
        finally:
            await deltas.aclose()  # a cut (or a client gone): the sequence leaves the batch
            self.ended_at = time.perf_counter()

    def _stop_type(self, finish_reason: str, token_ids: list[int]) -> str:
        if finish_reason == "length":
            return "limit"
        ends = self.generation.tokenizer.eos_token_ids | self.req.completion.options.stop_token_ids
        return "eos" if token_ids and token_ids[-1] in ends else "word"

    def final(self) -> dict[str, Any]:
        options = self.req.completion.options
        stop = options.stop
        return {
            "index": 0, "content": self.content, "tokens": [], "id_slot": 0, "stop": True,
            "model": self.generation.model_name, "tokens_predicted": self.predicted,
            "tokens_evaluated": self.evaluated, "generation_settings": _settings(self.req),
            "prompt": self.req.prompt_text, "has_new_line": "\n" in self.content, "truncated": False,
            "stop_type": self.stop_type,
            "stopping_word": stop[0] if self.stop_type == "word" and len(stop) == 1 else "",
            "tokens_cached": self.generation.num_cached_tokens, "timings": self._timings(),
        }  # fmt: skip

    def _timings(self) -> dict[str, float]:
        arrived, first = self.generation.arrived, self.first_token_at or self.ended_at or time.perf_counter()
        prompt_ms = (first - arrived) * 1000
        predicted_ms = ((self.ended_at or first) - first) * 1000
        prompt_n, predicted_n = self.evaluated, self.predicted
        return {
            "cache_n": self.generation.num_cached_tokens, "prompt_n": prompt_n, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
            "prompt_per_second": prompt_n / max(prompt_ms, 1e-6) * 1000,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(predicted_n, 1),
            "predicted_per_second": predicted_n / max(predicted_ms, 1e-6) * 1000,
        }  # fmt: skip


def _settings(req: InfillRequest) -> dict[str, Any]:
    options = req.completion.options
    sampling = options.sampling
    return {"n_predict": options.max_tokens, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "min_p": sampling.min_p, "seed": sampling.seed, "stop": list(options.stop),
            "n_indent": req.n_indent, "t_max_predict_ms": req.t_max_predict_ms, "stream": options.stream}  # fmt: skip
