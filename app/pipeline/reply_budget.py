"""How many tokens a reply may take: one rule for every API. Torch-free.

A request's budget is what it asks (OpenAI's ``max_tokens``, ``max_completion_tokens`` and ``max_output_tokens``,
Anthropic's ``max_tokens``, Ollama's ``num_predict``, llama.cpp's ``n_predict``) or, where it asks nothing, its
API maker's default (``COMPLETIONS_DEFAULT`` for OpenAI's completions, ``infill_default`` for llama.cpp's
``/infill``, up to the context for the chat APIs and Ollama's -1 and -2). On every API that budget is then
clamped to what the prompt leaves in the model's context (``reply_budget``): the reply ends there with the API's
``length`` (``max_tokens``, ``done_reason: length``), as llama.cpp's server and Anthropic's API end it and as
agents that ask for the whole context every turn need; a prompt that leaves no room for one token is a 400 in the
API's own shape, named by each pipeline. docs/api.md says which request each API clamps.
"""

from __future__ import annotations

#: OpenAI's completions' ``max_tokens`` where the request names none.
COMPLETIONS_DEFAULT = 16


def infill_default(context: int) -> int:
    """llama.cpp's ``/infill`` with ``n_predict`` -1 (its default): up to half the context, at most 4,096 tokens,
    keeping room for the prompt it lays out."""
    return min(context // 2, 4096)


def reply_budget(asked: int | None, prompt_tokens: int, context: int) -> int:
    """The most tokens a reply to ``prompt_tokens`` may take in ``context``: ``asked`` (None: up to the context),
    never more than the prompt leaves, at least 1 where it leaves nothing (the pipeline's 400 names that prompt);
    0 stays 0 (a prompt scored, nothing generated: OpenAI's ``echo``, llama.cpp's ``n_predict`` 0)."""
    room = max(context - prompt_tokens, 1)
    return room if asked is None else min(asked, room)
