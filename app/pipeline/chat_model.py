"""One served chat model as the endpoints use it: its names, tokenizer and limits, its chat template with tools in its
family's syntax, how its replies are read, its grammars, and the backend that runs its generations. Each generating
endpoint (``app/api/chat_completions.py``, ``completions.py``, ``responses.py``, ``anthropic_messages.py``,
``tokens.py``, ``infill.py``) routes a request's ``model`` to one (``ServerState.chat_model``) and goes on through it.
Torch-free."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Protocol

from app.pipeline.generation import Generation
from app.pipeline.harmony import encoding as harmony_encoding
from app.pipeline.harmony import prompt as harmony_prompt
from app.pipeline.harmony.encoding import MESSAGE, START, Harmony
from app.pipeline.harmony.grammar import reply_grammar
from app.pipeline.harmony.reader import HarmonyReader
from app.pipeline.reasoning import THINK, after_thought, budget_grammar, reasons, starts_inside
from app.pipeline.reply import Reading
from app.pipeline.reply_budget import reply_budget
from app.pipeline.tools import ToolCalling
from app.pipeline.tools.grammar import call_schema, tool_grammar
from app.pipeline.tools.prompt import render
from app.pipeline.tools.syntax import UNSUPPORTED, ToolSyntax, detect
from app.pipeline.tools.xml_parser import parameter_types
from app.server.metrics import Metrics
from app.services.backend import Backend, LocalBackend
from app.wire.openai.choices import Format
from app.wire.openai.errors import APIError, bad_request
from app.wire.openai.messages import Message
from app.wire.openai.sampling import GenerationOptions, StructuredOutput
from engine.chooser import ServedModel
from engine.core.grammar import Grammars
from engine.core.scheduler import Scheduler
from engine.core.tokenizer import ChatTemplateError, NoChatTemplate, Tokenizer


class Model(Protocol):
    """What the routes need to know of the model: ``engine.chooser.ServedModel`` in one process, what a replica
    tells the ingress on a cluster."""

    @property
    def name(self) -> str: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...


def local_backend(served: ServedModel, grammars: Grammars, max_queue: int, idle_release_s: float) -> LocalBackend:
    """This process's scheduler over ``served``'s engine."""
    scheduler = Scheduler(served.engine, served.tokenizer, max_queue=max_queue, engine_thread=served.engine_thread,
                          idle_release_s=idle_release_s)  # fmt: skip
    return LocalBackend(scheduler, grammars)


class ChatModel:
    """A chat model and the steps from a parsed request to its running generation."""

    def __init__(self, model: Model, names: tuple[str, ...], backend: Backend, grammars: Grammars,
                 metrics: Metrics) -> None:  # fmt: skip
        self.names = names
        self.name = names[0]
        self.tokenizer = model.tokenizer
        self.max_model_len = model.max_model_len
        #: Characters of text (other than white space) that could still fit the context.
        self.max_chars = self.max_model_len * model.tokenizer.max_token_chars
        self.grammars = grammars
        self.backend = backend
        self.metrics = metrics
        #: The family's tool-call syntax, read from the chat template and the vocabulary
        #: (``app/pipeline/tools/syntax.py``), and whether it reasons between tags (``app/pipeline/reasoning.py``;
        #: the tags' tokens kept in text).
        template = model.tokenizer.info().get("chat_template")
        self.tool_syntax = detect(template, model.tokenizer.added)
        #: The tags it reasons between (``<think>``, Gemma 4's thought channel), None where it does not reason.
        self.reasons = reasons(template)
        self.tags = self.reasons or THINK
        opening, closing = (model.tokenizer.added.get(tag) for tag in (self.tags.opening, self.tags.closing))
        #: The tags' token ids, where the model reasons and both are tokens.
        self.think_tags = (opening, closing) if self.reasons and opening is not None and closing is not None else None
        self.think_ids = frozenset(self.think_tags or ())
        #: gpt-oss's harmony (``app/pipeline/harmony/``): its prompts, replies and grammars; None for other models.
        self.harmony: Harmony | None = harmony_encoding.load(model.tokenizer)

    def chat_prompt(
        self, messages: list[Message], calling: ToolCalling | None = None, extra: dict[str, Any] | None = None
    ) -> list[int]:
        """The conversation through the model's template; tools through the template when it renders them, else through
        the default tool prompt (``app/pipeline/tools/``); ``extra``: more of the template's variables. Tools for a
        template whose call syntax this server cannot read back, a conversation the template refuses, or a model
        without a template: a 400. A
        harmony model's conversation is rendered by openai-harmony instead (``app/pipeline/harmony/prompt.py``)."""
        if self.harmony is not None:
            return harmony_prompt.render(self.harmony, messages, calling, extra or {})
        if calling is not None and self.tool_syntax is UNSUPPORTED:
            raise bad_request(
                "tools: this model's chat template writes tool calls in a syntax this server cannot read back "
                "(it reads Hermes <tool_call> JSON, Qwen3-Coder's and Qwen3.5's <function=...> XML, Llama 3.1 JSON and "
                "Mistral [TOOL_CALLS]); see docs/api.md",
                "tools",
            )
        rendered = render(messages, calling, self.tool_syntax)
        native = calling is not None and self.tool_syntax.native
        definitions = calling.definitions() if native and calling is not None else None
        try:
            return self.tokenizer.chat_prompt(rendered, definitions or None, extra)
        except NoChatTemplate:
            message = "messages: this model's files carry no chat template; send the prompt as text to /v1/completions"
            raise bad_request(message, "messages") from None
        except ChatTemplateError as exc:
            message = f"messages: the model's chat template refused the conversation: {exc}"
            raise bad_request(message, "messages") from None

    def call_syntax(self, calling: ToolCalling | None) -> ToolSyntax | None:
        """The syntax the reply's calls are read in; None where it may make none."""
        return self.tool_syntax if calling is not None and calling.calls_allowed else None

    def up_to_context(self, options: GenerationOptions, prompt: list[int]) -> GenerationOptions:
        """``options`` with the chat APIs' default ``max_tokens`` where they name none, as OpenAI's and Ollama's: up
        to the context (``app/pipeline/reply_budget.py``; an asked one is clamped per sequence by ``Generation``)."""
        if options.max_tokens is not None:
            return options
        room = reply_budget(None, len(prompt), self.max_model_len)
        return dataclasses.replace(options, max_tokens=room, min_tokens=min(options.min_tokens, room))

    def reading(self, calling: ToolCalling | None, prompt: list[int]) -> Reading:
        """How the replies to ``prompt`` are read: their calls, and their reasoning (inside it from the start where
        the prompt opened it)."""
        if self.harmony is not None:
            return self._harmony_reading(self.harmony, prompt)
        types = parameter_types(calling.definitions()) if calling is not None else {}
        reasons = self.reasons is not None
        return Reading(self.call_syntax(calling), reasons, self.opens_reasoning(prompt), self.tags, types=types)

    def opens_reasoning(self, prompt: list[int]) -> bool:
        """Whether ``prompt`` (its end) opened the reasoning the reply continues (a model that reasons)."""
        text = self.tokenizer.decode(prompt[-8:], skip_special_tokens=False)
        return self.reasons is not None and starts_inside(text, self.tags)

    @staticmethod
    def _harmony_reading(harmony: Harmony, prompt: list[int]) -> Reading:
        """Harmony's reader, primed with what the prompt holds of the reply (a prefill's header and text)."""
        primed = _reply_begun(harmony, prompt)
        return Reading(reasons=True, own=lambda: HarmonyReader(harmony, primed))

    def with_budget(self, options: GenerationOptions, calling: ToolCalling | None, reading: Reading,
                    budget: int | None) -> GenerationOptions:  # fmt: skip
        """``options`` whose reasoning ends after at most ``budget`` tokens (a grammar), where the model reasons and
        no other grammar holds the reply (a structured output's or the tools' leave no room for reasoning; harmony's
        reasoning has its own message, beside either)."""
        if budget is not None and self.harmony is not None:
            grammar = reply_grammar(self.harmony, calling, options.structured, budget)
            budgeted = StructuredOutput("grammar", grammar, "thinking.budget_tokens", whole=True)
            return dataclasses.replace(options, structured=budgeted)
        if budget is None or not self.reasons or options.structured is not None or calling is not None:
            return options
        grammar = budget_grammar(budget, reading.inside, self.think_tags, self.tags)
        budgeted = StructuredOutput("grammar", grammar, "thinking.budget_tokens", whole=True)
        return dataclasses.replace(options, structured=budgeted)

    def prompt_ids(self, prompt: str | list[int], param: str = "prompt") -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if any(t >= self.tokenizer.vocab_size for t in prompt):
            raise bad_request(f"{param} token ids must be below the vocabulary size {self.tokenizer.vocab_size}", param)
        return prompt

    def check_context(self, num_prompt: int, max_tokens: int, param: str) -> None:
        """A 400 for a prompt that leaves no room for one token (or does not fit, echoed alone). A ``max_tokens``
        beyond what the prompt leaves is not an error: the reply stops there, with ``length`` (``Generation``
        clamps each sequence's), as llama.cpp's server and Anthropic's API do, and as agents that ask for the
        whole context every turn (Qwen Code: 32,768 of a 32,768-token model) need."""
        if num_prompt + min(max_tokens, 1) > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the prompt has "
                f"{num_prompt} tokens, which leaves no room for the completion. Please reduce the prompt.",
                param,
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
        prompt_param: str = "prompt",
        **extra: Any,
    ) -> Generation:
        """The generation of ``prompts``; ``prompt_param``: the field that holds them (a prompt that leaves no room
        is a 400 naming it)."""
        assert options.max_tokens is not None, "the route fills in chat's default"
        for ids in prompts:
            self.check_context(len(ids), options.max_tokens, prompt_param)
        self.check_tokens(options)
        inside = self.harmony is not None and self.harmony.ids[MESSAGE] in _reply_begun(self.harmony, prompts[0])
        grammar = await self.grammar(options, calling, inside, self.opens_reasoning(prompts[0]))
        syntax = self.call_syntax(calling)
        kept = (syntax.kept_special if syntax is not None else frozenset()) | self.think_ids
        if self.harmony is not None:  # the reader sees the markers; a call ends the reply as <|return|> does
            kept |= self.harmony.marker_ids
            options = dataclasses.replace(options, stop_token_ids=options.stop_token_ids | self.harmony.stop_ids)
        return kind(
            self.backend, self.metrics, self.tokenizer, self.name, fmt, options, prompts, echo_texts, arrived,
            grammar, kept_special=kept, context=self.max_model_len, **extra,
        )  # fmt: skip

    async def grammar(
        self, options: GenerationOptions, calling: ToolCalling | None, inside: bool = False, thinking: bool = False
    ) -> str | None:
        """What every sequence's tokens must follow: the structured output asked for, else the calls the tools
        allow (with ``tool_choice: "none"``, text that starts no call; after the reasoning of a model that reasons,
        ``thinking``: the prompt opened it), else nothing. A harmony reply's grammar holds its shape too
        (``app/pipeline/harmony/grammar.py``; ``inside``: the prompt opened its final message)."""
        structured = options.structured
        if self.harmony is not None and not (structured is not None and structured.whole):
            grammar = reply_grammar(self.harmony, calling, structured, None, inside)
            param = structured.param if structured is not None else "tools"
            return None if grammar is None else await self.compile(StructuredOutput("grammar", grammar, param))
        if options.structured is not None:
            return await self.compile(options.structured)
        if calling is not None:
            return await self.compile_tools(calling, thinking)
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

    async def compile_tools(self, calling: ToolCalling, thinking: bool = False) -> str:
        """The grammar of the calls ``calling`` allows, after the reasoning where the model reasons (``thinking``:
        the prompt opened it); a 400 naming the tool whose parameters do not compile."""
        grammar = tool_grammar(calling, self.tool_syntax)
        if self.reasons:
            grammar = after_thought(grammar, thinking, self.think_tags, self.tags)
        try:
            return await self.compile(StructuredOutput("grammar", grammar, "tools"))
        except APIError:
            for index, tool in enumerate(calling.tools):
                param = calling.parameters_param(index)
                try:
                    Grammars.check(Grammars.json_schema(call_schema(tool, self.tool_syntax.arguments_key)))
                except ValueError as exc:
                    raise bad_request(f"{param}: {exc}", param) from None
            raise


def _reply_begun(harmony: Harmony, prompt: list[int]) -> tuple[int, ...]:
    """What a harmony prompt holds of the reply: the tokens after its last ``<|start|>`` and the assistant's role."""
    last = len(prompt) - 1 - prompt[::-1].index(harmony.ids[START])
    return tuple(prompt[last + 2 :])
