"""Speculative decoding's verification: which of a draft's tokens a step's logits accept.

A verifying sequence's rows are its pending token and its draft ``d1..dk``; row ``i``'s logits are the model's
distribution for the token after ``d1..di`` (``engine/core/planner.py`` plans them). Greedy rows take each row's
argmax, as decoding one token at a time would: the draft's longest prefix that matches, then the argmax after it.
With batch-invariant kernels a row's logits do not depend on the rows beside it, so those tokens and their logprobs
are bitwise the ones that decoding without a draft gives. Sampled rows do the same: each row draws its token as
decoding would (``sampler.select_tokens``), and the draft's prefix that matches the drawn tokens is accepted, with
the token drawn after it. Row ``i``'s token is a draw from the model's distribution after ``d1..di`` (the draft
up to it matched what was drawn before, so that is the sequence's true context), so each emitted token is
distributed exactly as without the draft, and ``di`` is accepted with probability ``p(di)``, as speculative
rejection sampling for a draft with all its mass on one token would accept it. A seeded row's uniform number for its
``n``-th token is keyed by ``n`` (``sampler.keyed_uniform``), so a seeded request's text is the one it has without
speculation, token for token.
"""

from __future__ import annotations

import torch

from engine.core.types import TokenLogprob
from engine.runtime.sampler import Row, select_tokens

Picked = tuple[int, TokenLogprob | None]


def accept(logits: torch.Tensor, rows: list[Row], drafts: list[tuple[list[int], int]]) -> list[list[Picked]]:
    """``logits`` ``[rows, vocab]``, one ``Row`` each; ``drafts``: each sequence's draft and its number of rows
    (1 + its draft's length), in row order. Returns each sequence's tokens (1 to 1 + its draft's length)."""
    tokens, logprobs = select_tokens(logits, rows)
    picked = list(zip(tokens.tolist(), logprobs, strict=True))
    result, first = [], 0
    for draft, count in drafts:
        mine = picked[first : first + count]
        result.append(mine[: accepted_prefix(draft, [token for token, _ in mine]) + 1])
        first += count
    return result


def accepted_prefix(draft: list[int], chosen: list[int]) -> int:
    """How many of the draft's first tokens the rows chose: row ``i`` chose the token after ``d1..di``."""
    accepted = 0
    while accepted < len(draft) and chosen[accepted] == draft[accepted]:
        accepted += 1
    return accepted
