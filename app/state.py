"""The server's state: what every endpoint's pipeline shares (``app/chat.py``, ``completions.py``, ``responses.py``,
``messages.py``, ``tokens.py``): parsing on worker threads, the model's limits, the chat template with tools in the
family's syntax, how replies are read, grammar compilation, queueing, and the answer. Torch-free."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prometheus_client import Gauge
from sse_starlette import EventSourceResponse
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from app.backend import Backend, LocalBackend
from app.embeddings import MAX_INPUTS, EmbeddingService
from app.generation import Generation
from app.limits import RequestLimits, check_lists
from app.metrics import Metrics
from app.models import ModelRegistry, ServedEntry
from app.openai.choices import Format
from app.openai.embeddings import EmbeddingsRequest, parse_embeddings_request
from app.openai.errors import APIError, bad_request
from app.openai.messages import Message
from app.openai.request import parse_json_object, parse_model
from app.openai.sampling import GenerationOptions, StructuredOutput
from app.reasoning import CLOSE as THINK_CLOSE
from app.reasoning import OPEN as THINK_OPEN
from app.reasoning import reasons, starts_inside
from app.reply import Reading
from app.response_store import STORE_SIZE, ResponseStore
from app.tools import ToolCalling
from app.tools.grammar import call_schema, tool_grammar
from app.tools.prompt import render
from app.tools.syntax import UNSUPPORTED, ToolSyntax, detect
from engine.chooser import ServedModel
from engine.core.config import IDLE_RELEASE_S, MAX_QUEUE
from engine.core.encoder import Encoder
from engine.core.grammar import Grammars
from engine.core.heap import trim_heap
from engine.core.scheduler import QueueFullError, Scheduler
from engine.core.tokenizer import ChatTemplateError, Tokenizer

T = TypeVar("T")
#: Threads that parse, tokenize and render requests off the event loop: as many as the machine's two cores, so a
#: burst of large requests queues here instead of taking the CPU from the engine's steps.
PREPARE_WORKERS = 2
#: A body this large has its memory handed back to the OS once its request is prepared.
TRIM_AFTER_BYTES = 1 << 20


@dataclass(slots=True, frozen=True)
class ServerConfig:
    #: The name clients must send as ``model``; ``None`` uses the model's own name.
    served_model_name: str | None = None
    #: More names the chat model answers to (vLLM's ``--served-model-name a b``).
    model_aliases: tuple[str, ...] = ()
    #: The names of the embedding model; empty: its own name.
    embedding_model_names: tuple[str, ...] = ()
    #: Inputs one embeddings request may carry.
    max_embedding_inputs: int = MAX_INPUTS
    #: Requests allowed to wait for a batch slot before new ones get 429.
    max_queue: int = MAX_QUEUE
    #: Seconds the engine may sit idle before it hands back the KV memory it keeps for the next requests.
    kv_cache_idle_release_s: float = IDLE_RELEASE_S
    #: When set, ``Authorization: Bearer <key>`` is required on /v1/* and /tokenize, /detokenize.
    api_key: str | None = None
    #: Origins allowed by CORS; empty means no CORS headers.
    cors_origins: tuple[str, ...] = ()
    #: Seconds between SSE comment lines (``: ping``) on a quiet stream; ``None`` sends none, as OpenAI does
    #: (simple ``data:``-only parsers choke on them), but a proxy that cuts idle connections may need them.
    sse_keepalive_s: float | None = None
    #: What one request may ask before admission (``--max-request-bytes`` and list lengths: ``app/limits.py``).
    limits: RequestLimits = field(default_factory=RequestLimits)
    #: Responses kept for ``previous_response_id`` and ``GET /v1/responses/{id}`` (least recently used leave first).
    responses_store_size: int = STORE_SIZE


class Model(Protocol):
    """What the routes need to know of the model: ``engine.chooser.ServedModel`` in one process, what a replica
    tells the ingress on a cluster."""

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...


def local_backend(served: ServedModel, config: ServerConfig, grammars: Grammars) -> LocalBackend:
    """This process's scheduler over ``served``'s engine."""
    scheduler = Scheduler(
        served.engine,
        served.tokenizer,
        max_queue=config.max_queue,
        engine_thread=served.engine_thread,
        idle_release_s=config.kv_cache_idle_release_s,
    )
    return LocalBackend(scheduler, grammars)


class ServerState:
    """Everything the routes share, built once per app: the model's name, tokenizer and limits, the backend that
    runs generations, the metrics, and the steps from a request body to a running generation. Reached from a
    request as ``request.app.state.server`` (``server_state``)."""

    def __init__(self, model: Model, config: ServerConfig, backend: Backend | None) -> None:
        self.model_name = config.served_model_name or model.name
        self.tokenizer = model.tokenizer
        self.max_model_len = model.max_model_len
        self.limits = config.limits
        self.max_queue = config.max_queue
        self.max_embedding_inputs = config.max_embedding_inputs
        #: Characters of text (other than white space) that could still fit the context.
        self.max_chars = self.max_model_len * model.tokenizer.max_token_chars
        self.workers = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="prepare")
        self.grammars = Grammars(model.tokenizer)
        if backend is None:
            assert isinstance(model, ServedModel), "without a backend the app runs the model's engine itself"
            backend = local_backend(model, config, self.grammars)
        self.backend = backend
        self.metrics = Metrics()
        backend.register_metrics(self.metrics.registry)
        #: The family's tool-call syntax, read from the chat template and the vocabulary (``app/tools/syntax.py``),
        #: and whether it reasons between ``<think>`` tags (``app/reasoning.py``; the tags' tokens kept in text).
        template = model.tokenizer.info().get("chat_template")
        self.tool_syntax = detect(template, model.tokenizer.added)
        self.reasons = reasons(template)
        think = [model.tokenizer.added.get(tag) for tag in (THINK_OPEN, THINK_CLOSE)]
        self.think_ids = frozenset(t for t in think if t is not None and self.reasons)
        self.created = int(time.time())
        self.sse_ping = config.sse_keepalive_s or 0  # sse-starlette: 0 sends no pings
        #: Set when shutdown begins: new requests get 503 while in-flight ones finish.
        self.draining = False
        self.registry, self.embeddings = self._models(model, config)
        self.responses = ResponseStore(config.responses_store_size)
        stored = Gauge("smolserve:responses_stored", "Responses kept for previous_response_id and retrieval",
                       registry=self.metrics.registry)  # fmt: skip
        stored.set_function(lambda: len(self.responses))

    def _models(self, model: Model, config: ServerConfig) -> tuple[ModelRegistry, EmbeddingService | None]:
        """The served models: the chat model, then the embedding model beside it (run on the engine's thread)."""
        chat = ServedEntry((self.model_name, *config.model_aliases), "generate", self.max_model_len)
        encoder: Encoder | None = getattr(model, "encoder", None)
        if encoder is None:
            return ModelRegistry([chat], self.created), None
        entry = ServedEntry(config.embedding_model_names or (encoder.name,), "embed", encoder.max_seq_length)
        scheduler = getattr(self.backend, "scheduler", None)

        def chat_step_seconds() -> float | None:
            return scheduler.last_step_s if scheduler is not None and scheduler.num_running else None

        executor = getattr(model, "engine_thread", None)
        service = EmbeddingService(encoder, entry, executor, self.metrics.registry, chat_step_seconds)
        return ModelRegistry([chat, entry], self.created), service

    async def start(self) -> None:
        await self.backend.start()
        if self.embeddings is not None:
            await self.embeddings.batcher.start()

    async def stop(self) -> None:
        if self.embeddings is not None:
            await self.embeddings.batcher.stop()
        await self.backend.stop()
        self.workers.shutdown(wait=False)

    def check_model(self, model: str | None) -> None:
        """``model`` of a generating request: the chat model (or none named)."""
        self.registry.route(model, "generate")

    def prepare_embeddings(self, raw: bytes) -> tuple[EmbeddingsRequest, list[list[int]]]:
        """On a worker: the request and each input's token ids, every check passed."""
        body = self.parse_body(raw)
        self.registry.route(parse_model(body), "embed")  # a 404 or a 400 before anything else
        assert self.embeddings is not None, "the registry routes to an embedding model only when one is served"
        req = parse_embeddings_request(body, self.max_embedding_inputs)
        return req, self.embeddings.token_ids(req)

    async def prepare(self, work: Callable[[], T], size: int) -> T:
        """Run ``work`` (parsing a body of ``size`` bytes, tokenizing, rendering a template) on the worker pool, so
        that streams keep flowing while it runs; after a large body, hand the heap's freed memory back."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self.workers, work)
        finally:
            if size > TRIM_AFTER_BYTES:
                await loop.run_in_executor(self.workers, trim_heap)

    def parse_body(self, raw: bytes) -> dict[str, Any]:
        """The body as a JSON object whose lists are within the limits (``app/limits.py``); else a 400."""
        return parse_json_object(raw, lambda body: check_lists(body, self.limits, self.max_queue))

    def chat_prompt(
        self, messages: list[Message], calling: ToolCalling | None = None, extra: dict[str, Any] | None = None
    ) -> list[int]:
        """The conversation through the model's template; tools through the template when it renders them, else
        through the default tool prompt (``app/tools/``); ``extra``: more of the template's variables. Tools for a
        template whose call syntax this server cannot read back, or a conversation the template refuses: a 400."""
        if calling is not None and self.tool_syntax is UNSUPPORTED:
            raise bad_request(
                "tools: this model's chat template writes tool calls in a syntax this server cannot read back "
                "(it reads Hermes <tool_call> JSON, Llama 3.1 JSON and Mistral [TOOL_CALLS]); see docs/api.md",
                "tools",
            )
        rendered = render(messages, calling, self.tool_syntax)
        native = calling is not None and self.tool_syntax.native
        definitions = calling.definitions() if native and calling is not None else None
        try:
            return self.tokenizer.chat_prompt(rendered, definitions or None, extra)
        except ChatTemplateError as exc:
            message = f"messages: the model's chat template refused the conversation: {exc}"
            raise bad_request(message, "messages") from None

    def call_syntax(self, calling: ToolCalling | None) -> ToolSyntax | None:
        """The syntax the reply's calls are read in; None where it may make none."""
        return self.tool_syntax if calling is not None and calling.calls_allowed else None

    def up_to_context(self, options: GenerationOptions, prompt: list[int]) -> GenerationOptions:
        """Chat's and the Responses API's default ``max_tokens``, as OpenAI's: up to the context length."""
        if options.max_tokens is not None:
            return options
        room = max(self.max_model_len - len(prompt), 1)
        return dataclasses.replace(options, max_tokens=room, min_tokens=min(options.min_tokens, room))

    def reading(self, calling: ToolCalling | None, prompt: list[int]) -> Reading:
        """How the replies to ``prompt`` are read: their calls, and their reasoning (inside it from the start where
        the prompt opened it)."""
        inside = self.reasons and starts_inside(self.tokenizer.decode(prompt[-8:], skip_special_tokens=False))
        return Reading(self.call_syntax(calling), self.reasons, inside)

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if any(t >= self.tokenizer.vocab_size for t in prompt):
            raise bad_request(f"{param} token ids must be below the vocabulary size {self.tokenizer.vocab_size}", param)
        return prompt

    def check_context(self, num_prompt: int, max_tokens: int) -> None:
        if num_prompt + max_tokens > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} in the completion). "
                "Please reduce the prompt or max_tokens.",
                "max_tokens",
            )

    def check_tokens(self, options: GenerationOptions) -> None:
        vocab = self.tokenizer.vocab_size
        if any(token >= vocab for token, _ in options.sampling.logit_bias):
            raise bad_request(f"logit_bias token ids must be below the vocabulary size {vocab}", "logit_bias")
        if any(token >= vocab for token in options.stop_token_ids):
            raise bad_request(f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")

    async def generation(
        self,
        fmt: Format,
        options: GenerationOptions,
        prompts: list[list[int]],
        echo_texts: list[str] | None,
        arrived: float,
        calling: ToolCalling | None = None,
        kind: type[Generation] = Generation,
        **extra: Any,
    ) -> Generation:
        assert options.max_tokens is not None, "the route fills in chat's default"
        for ids in prompts:
            self.check_context(len(ids), options.max_tokens)
        self.check_tokens(options)
        grammar = await self.grammar(options, calling)
        syntax = self.call_syntax(calling)
        kept = (syntax.kept_special if syntax is not None else frozenset()) | self.think_ids
        return kind(
            self.backend, self.metrics, self.tokenizer, self.model_name, fmt, options, prompts, echo_texts, arrived,
            grammar, kept_special=kept, **extra,
        )  # fmt: skip

    async def grammar(self, options: GenerationOptions, calling: ToolCalling | None) -> str | None:
        """What every sequence's tokens must follow: the structured output asked for, else the calls the tools
        allow (with ``tool_choice: "none"``, text that starts no call), else nothing."""
        if options.structured is not None:
            return await self.compile(options.structured)
        if calling is not None:
            return await self.compile_tools(calling)
        return None

    async def compile(self, structured: StructuredOutput) -> str:
        """Compile the grammar (off the event loop; cached) before anything is admitted: a bad one is a 400.
        Returns the grammar, which each sequence's matcher is made from where it runs."""
        kind, value = structured.kind, structured.value
        build = {
            "json": Grammars.json_schema, "regex": Grammars.regex, "choice": Grammars.choice, "grammar": Grammars.lark,
        }  # fmt: skip
        try:
            grammar = build[kind](value)
            await asyncio.to_thread(self.grammars.matcher, grammar)
        except ValueError as exc:  # GrammarError among them
            raise bad_request(f"{structured.param}: {exc}", structured.param) from None
        return grammar

    async def compile_tools(self, calling: ToolCalling) -> str:
        """The grammar of the calls ``calling`` allows; a 400 naming the tool whose parameters do not compile."""
        try:
            return await self.compile(StructuredOutput("grammar", tool_grammar(calling, self.tool_syntax), "tools"))
        except APIError:
            for index, tool in enumerate(calling.tools):
                param = calling.parameters_param(index)
                try:
                    Grammars.check(Grammars.json_schema(call_schema(tool, self.tool_syntax.arguments_key)))
                except ValueError as exc:
                    raise bad_request(f"{param}: {exc}", param) from None
            raise

    async def respond(
        self, request: Request, generation: Generation, complete: Callable[[], Awaitable[dict[str, Any]]] | None = None,
        events: Callable[[], AsyncIterator[str]] | None = None,
    ) -> Response:  # fmt: skip
        """Queue the generation's sequences and answer: a stream of events, or JSON when all are done (the
        endpoint's shapes: ``complete`` and ``events``, the OpenAI ones by default)."""
        if self.draining:
            raise APIError(503, "The server is shutting down; retry on another instance.", code="shutting_down")
        try:
            await generation.submit()
        except QueueFullError as exc:
            raise APIError(429, str(exc), code="queue_full", headers={"Retry-After": "1"}) from None
        self.metrics.prompt_tokens.inc(generation.num_prompt_tokens)
        request.state.usage = (generation.num_prompt_tokens, 0, 0, 0)
        request.state.replica = generation.replicas
        if generation.options.stream:
            stream = _logged(request, generation, (events or generation.events)())
            return EventSourceResponse(stream, sep="\n", ping=self.sse_ping)
        done = asyncio.ensure_future((complete or generation.complete)())
        hangup = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({done, hangup}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hangup.cancel()
            if not done.done():
                done.cancel()
            generation.abort()
        request.state.usage = _usage_for_log(generation)
        if not done.done() or done.cancelled():
            return Response(status_code=499)  # the client left; nobody is listening
        return JSONResponse(done.result())


async def _logged(request: Request, generation: Generation, events: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield event
    finally:
        request.state.usage = _usage_for_log(generation)


def _usage_for_log(generation: Generation) -> tuple[int, int, int, int]:
    return (
        generation.num_prompt_tokens, generation.num_completion_tokens, generation.num_cached_tokens,
        generation.num_accepted_tokens,
    )  # fmt: skip


def server_state(source: Request | Starlette) -> ServerState:
    """The state of the app serving a request, or of an app."""
    app = source.app if isinstance(source, Request) else source
    return app.state.server


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
