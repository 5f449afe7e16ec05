"""Speculative decoding's verification: which of a draft's tokens a step's logits accept.

A verifying sequence's rows are its pending token and its draft ``d1..dk``; row ``i``'s logits are the model's
distribution for the token after ``d1..di`` (``engine/core/planner.py`` plans them). Greedy rows take each row's
argmax, as decoding one token at a time would: the draft's longest prefix that matches, then the argmax after it.
With batch-invariant kernels a row's logits do not depend on the rows beside it, so those tokens and their logprobs
are bitwise the ones that decoding without a draft gives. Sampled rows use speculative rejection sampling for a
draft that puts all its mass on one token: ``di`` is accepted with probability ``p(di)`` (``p`` the row's
distribution after its penalties, temperature, top-k, top-p and min-p); on the first rejection the token is
drawn from ``p`` without ``di``, renormalized; after a whole accepted draft the last row draws the next token.
Each emitted token is then distributed exactly as without the draft.
"""

from __future__ import annotations

import torch

from engine.core.types import TokenLogprob
from engine.runtime.sampler import Row, select_tokens, verify_draft

Picked = tuple[int, TokenLogprob | None]


def accept(logits: torch.Tensor, rows: list[Row], drafts: list[tuple[list[int], int]]) -> list[list[Picked]]:
    """``logits`` ``[rows, vocab]``, one ``Row`` each; ``drafts``: each sequence's draft and its number of rows
    (1 + its draft's length), in row order. Returns each sequence's tokens (1 to 1 + its draft's length)."""
    spans, start = [], 0
    for draft, count in drafts:
        spans.append((start, count, draft))
        start += count
    rejection = {i for i, (first, _, draft) in enumerate(spans) if draft and not rows[first].params.is_greedy}
    plain = [r for i, (first, count, _) in enumerate(spans) if i not in rejection for r in range(first, first + count)]
    chosen: dict[int, Picked] = {}
    if plain:
        tokens, logprobs = select_tokens(logits[plain], [rows[r] for r in plain])
        chosen = dict(zip(plain, zip(tokens.tolist(), logprobs, strict=True), strict=True))
    result = []
    for i, (first, count, draft) in enumerate(spans):
        if i in rejection:
            result.append(verify_draft(logits[first : first + count], rows[first : first + count], draft))
            continue
        picked = [chosen[r] for r in range(first, first + count)]
        result.append(picked[: accepted_prefix(draft, [token for token, _ in picked]) + 1])
    return result


def accepted_prefix(draft: list[int], chosen: list[int]) -> int:
    """How many of the draft's first tokens the rows chose: row ``i`` chose the token after ``d1..di``."""
    accepted = 0
    while accepted < len(draft) and chosen[accepted] == draft[accepted]:
        accepted += 1
    return accepted
