"""Token selection for a whole step at once: greedy and sampled rows, vectorized over the batch.

Sampling uses the exponential-race form of a categorical draw (argmax of ``probs / q`` with
``q ~ Exp(1)``), so each row's randomness is one tensor of noise: a seeded row fills its own from its own
generator, which advances the same way whether the sequence runs alone or in a busy batch.
"""

from __future__ import annotations

import torch

from engine.types import SamplingParams


def select_tokens(
    logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
) -> torch.Tensor:
    """``logits`` is float32 ``[rows, vocab]``; returns one token id per row."""
    greedy = logits.argmax(dim=-1)
    sampled_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if not sampled_rows:
        return greedy
    rows = torch.tensor(sampled_rows, device=logits.device)
    chosen = [params[i] for i in sampled_rows]
    scaled = logits[rows] / torch.tensor([p.temperature for p in chosen], device=logits.device)[:, None]
    if any(p.top_k > 0 for p in chosen):
        scaled = _top_k(scaled, [p.top_k for p in chosen])
    if any(p.top_p < 1.0 for p in chosen):
        scaled = _top_p(scaled, torch.tensor([p.top_p for p in chosen], device=logits.device))
    probs = scaled.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, index in enumerate(sampled_rows):
        if generators[index] is not None:
            noise[row].exponential_(generator=generators[index])
    greedy[rows] = (probs / noise).argmax(dim=-1)
    return greedy


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in ks], device=logits.device)
    top = logits.topk(int(k.max()), dim=-1).values
    kth = top.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already cover top_p; the first token always stays.
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)
