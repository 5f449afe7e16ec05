"""Token selection for a whole step at once: every row with its own parameters, vectorized over the batch.

Order, as in vLLM: a structured-output row's grammar masks what it may not generate; suppressed tokens (EOS
before ``min_tokens``), ``logit_bias`` and penalties adjust the logits; greedy rows take the argmax; sampled
rows apply temperature, top-k, top-p and min-p and draw. The draw inverts the row's cumulative distribution at one
uniform number, so a row's randomness is one number a token. A seeded row's number for its ``n``-th output token is
a hash of its seed and ``n`` (``keyed_uniform``): the same whether it runs alone or in a busy batch, after a
preemption, or as a row verifying a speculative draft, so a seeded request's text is the same in all of them.
(An exponential race, one random number per vocabulary entry, cost ~1 ms a row a step over SmolLM2's 49,152
tokens; a full sort for top-p ~4 ms: top-p now looks at the 256 most likely tokens first, which hold the nucleus
unless the distribution is flat.)
Logprobs are those of the model's raw distribution.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from engine.core.types import Constraint, SamplingParams, TokenLogprob


@dataclass(slots=True)
class Row:
    """What the sampler needs to know about one sequence."""

    params: SamplingParams
    seed: int | None = None  # a seeded row's uniform numbers are ``keyed_uniform(seed, len(output_ids))``
    prompt_ids: tuple[int, ...] = ()
    output_ids: tuple[int, ...] | list[int] = ()
    banned: frozenset[int] = frozenset()  # tokens that may not be chosen this step
    num_logprobs: int | None = None
    constraint: Constraint | None = None  # structured output: the tokens its grammar allows next


def select_tokens(logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, list[TokenLogprob | None]]:
    """``logits`` is float32 ``[rows, vocab]``; returns one token id per row, and its logprob where asked."""
    raw = logits
    logits = _adjust(_constrain(logits, rows), rows)
    sampled = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    greedy = [i for i, row in enumerate(rows) if row.params.is_greedy]
    if not sampled:
        tokens = logits.argmax(dim=-1)
    elif not greedy:
        tokens = _sample(logits, rows)
    else:
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        tokens[greedy] = logits[greedy].argmax(dim=-1)
        tokens[sampled] = _sample(logits[sampled], [rows[i] for i in sampled])
    return tokens, _logprobs(raw, tokens, rows)


def keyed_uniform(seed: int, index: int) -> float:
    """A uniform number in [0, 1) for a seeded sequence's ``index``-th output token: 53 bits of a hash of both."""
    key = (seed % 2**64).to_bytes(8, "little") + index.to_bytes(8, "little")
    return (int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 11) / 2**53


def _constrain(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Disallowed tokens of constrained rows to -inf (rows without a constraint pay nothing)."""
    constrained = [(i, row.constraint) for i, row in enumerate(rows) if row.constraint is not None]
    if not constrained:
        return logits
    vocab = logits.shape[-1]
    masks = [np.frombuffer(constraint.allowed_tokens(), dtype=np.uint8) for _, constraint in constrained]
    bits = np.unpackbits(np.stack(masks), axis=1, bitorder="little")  # bit t % 8 of byte t // 8 is token t
    allowed = np.zeros((len(masks), vocab), dtype=bool)
    width = min(vocab, bits.shape[1])  # tokens past the grammar's vocabulary are never allowed
    allowed[:, :width] = bits[:, :width]
    logits = logits.clone()
    index = [i for i, _ in constrained]
    logits[index] = logits[index].masked_fill(~torch.from_numpy(allowed).to(logits.device), float("-inf"))
    return logits


def _adjust(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    banned = [(i, sorted(row.banned)) for i, row in enumerate(rows) if row.banned]
    biased = [(i, row.params.logit_bias) for i, row in enumerate(rows) if row.params.logit_bias]
    penalized = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not (banned or biased or penalized):
        return logits
    logits = logits.clone()
    for i, ids in banned:
        logits[i, ids] = float("-inf")
    for i, bias in biased:
        ids, values = zip(*bias, strict=True)
        logits[i, list(ids)] += torch.tensor(values, device=logits.device)
    if penalized:
        logits[penalized] = _penalize(logits[penalized], [rows[i] for i in penalized])
    return logits


def _penalize(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    vocab = logits.shape[-1]
    outputs = _counts([row.output_ids for row in rows], vocab, logits.device)
    seen = (outputs + _counts([row.prompt_ids for row in rows], vocab, logits.device)) > 0
    device = logits.device
    repetition = torch.tensor([row.params.repetition_penalty for row in rows], device=device)[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    frequency = torch.tensor([row.params.frequency_penalty for row in rows], device=device)[:, None]
    presence = torch.tensor([row.params.presence_penalty for row in rows], device=device)[:, None]
    return logits - frequency * outputs - presence * (outputs > 0)


def _counts(sequences: list, vocab: int, device: torch.device) -> torch.Tensor:
    """``[len(sequences), vocab]`` token counts; padding goes to an extra column that is dropped."""
    width = max((len(ids) for ids in sequences), default=0)
    index = torch.full((len(sequences), max(width, 1)), vocab, dtype=torch.long)
    for i, ids in enumerate(sequences):
        index[i, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    counts = torch.zeros(len(sequences), vocab + 1, device=device)
    counts.scatter_add_(1, index.to(device), torch.ones(index.shape, device=device))
    return counts[:, :vocab]


def _sample(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """Sampled rows' tokens. A row whose top-k or top-p keeps only tokens among its ``NUCLEUS_CANDIDATES`` most
    likely ones (the usual case for both) draws from those alone; the others from the whole vocabulary."""
    device = logits.device
    logits = logits / torch.tensor([row.params.temperature for row in rows], device=device)[:, None]
    if any(row.params.top_k > 0 for row in rows):
        logits = _top_k(logits, [row.params.top_k for row in rows])
    top_p = torch.tensor([row.params.top_p for row in rows], device=device)
    tokens = torch.empty(len(rows), dtype=torch.long, device=device)
    count = min(NUCLEUS_CANDIDATES, logits.shape[-1])
    # Only rows that truncate can be held by their candidates: the others skip the search.
    truncated = [i for i, row in enumerate(rows) if row.params.top_p < 1.0 or 0 < row.params.top_k <= count]
    inside: list[int] = []
    if truncated:
        candidates = logits if len(truncated) == len(rows) else logits[truncated]  # a copy only when needed
        values, ids = candidates.topk(count, dim=-1)  # descending
        probs = (values - candidates.logsumexp(dim=-1, keepdim=True)).exp()
        covered = probs.cumsum(dim=-1)
        p = top_p[truncated]
        kept_by_top_k = torch.tensor([0 < rows[i].params.top_k <= count for i in truncated], device=device)
        held = ((p < 1.0) & (covered[:, -1] > p)) | kept_by_top_k
        at = held.nonzero()[:, 0].tolist()  # the nucleus ends among the candidates (or top-k keeps only them)
        inside = [truncated[j] for j in at]
        if inside:
            kept = values[at].masked_fill((covered - probs)[at] > p[at, None], float("-inf"))
            chosen = _draw(_min_p(kept.softmax(dim=-1), [rows[i] for i in inside]), [rows[i] for i in inside])
            tokens[inside] = ids[at].gather(-1, chosen[:, None])[:, 0]
    outside = sorted(set(range(len(rows))) - set(inside))
    if outside:
        whole = logits[outside]
        nucleus = [j for j, i in enumerate(outside) if rows[i].params.top_p < 1.0]  # flat: sort the whole row
        if nucleus:
            whole[nucleus] = _top_p_sorted(whole[nucleus], top_p[[outside[j] for j in nucleus]])
        tokens[outside] = _draw(_min_p(whole.softmax(dim=-1), [rows[i] for i in outside]), [rows[i] for i in outside])
    return tokens


def _min_p(probs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    if not any(row.params.min_p > 0 for row in rows):
        return probs
    min_p = torch.tensor([row.params.min_p for row in rows], device=probs.device)[:, None]
    return probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)


def _draw(probs: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """One index per row of ``probs`` (any non-negative weights): the first whose cumulative weight passes ``u``
    times the row's total, ``u`` uniform in [0, 1): a seeded row's ``keyed_uniform``, another's a fresh one."""
    uniform = torch.rand(len(rows))
    for i, row in enumerate(rows):
        if row.seed is not None:
            uniform[i] = keyed_uniform(row.seed, len(row.output_ids))
    cumulative = probs.cumsum(dim=-1)
    target = uniform.to(probs.device)[:, None] * cumulative[:, -1:]
    chosen = torch.searchsorted(cumulative, target, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
    # u within float rounding of 1 can pass the total: the last index with any weight takes it.
    unweighted = (probs.gather(-1, chosen[:, None])[:, 0] == 0).nonzero()[:, 0]
    if len(unweighted):
        chosen[unweighted] = (probs[unweighted] > 0).cumsum(dim=-1).argmax(dim=-1)
    return chosen


def _top_k(logits: torch.Tensor, ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([min(k, vocab) if k > 0 else vocab for k in ks], device=logits.device)
    top = logits.topk(int(k.max()), dim=-1).values
    kth = top.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


#: Top-k and top-p look for each row's tokens among this many most likely ones before the whole vocabulary.
NUCLEUS_CANDIDATES = 256


def _top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Drop a token when the more likely tokens before it already cover ``top_p`` (the first always stays)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    drop = (sorted_probs.cumsum(dim=-1) - sorted_probs) > top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def _logprobs(raw: torch.Tensor, tokens: torch.Tensor, rows: list[Row]) -> list[TokenLogprob | None]:
    wanted = [i for i, row in enumerate(rows) if row.num_logprobs is not None]
    result: list[TokenLogprob | None] = [None] * len(rows)
    if wanted:
        scored = token_logprobs(raw[wanted], tokens[wanted], [rows[i].num_logprobs or 0 for i in wanted])
        for i, entry in zip(wanted, scored, strict=True):
            result[i] = entry
    return result


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, num_top: list[int]) -> list[TokenLogprob]:
    """Row i's ``tokens[i]`` under the raw distribution ``logits[i]``, with its ``num_top[i]`` most likely
    alternatives. Used for sampled tokens and for scored prompt tokens alike."""
    if not num_top:
        return []
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens[:, None])[:, 0].tolist()
    top_values, top_ids = _top(logprobs, max(max(num_top), 1))
    return [
        TokenLogprob(token, chosen[i], tuple(zip(top_ids[i][:n], top_values[i][:n], strict=True)))
        for i, (token, n) in enumerate(zip(tokens.tolist(), num_top, strict=True))
    ]


def _top(logprobs: torch.Tensor, k: int) -> tuple[list[list[float]], list[list[int]]]:
    """Each row's ``k`` largest values and their ids, equal values in the order of their ids (the lowest first, as
    ``argmax`` picks it). ``topk`` leaves the order among equal values to its implementation, which changed with
    the number of rows in the call: bfloat16 logits tie often, and a row's alternatives then depended on its
    batchmates."""
    values, ids = [], []
    kth = logprobs.topk(k, dim=-1).values[:, -1:]
    for row, floor in zip(logprobs, kth, strict=True):
        candidates = (row >= floor).nonzero()[:, 0]  # ascending ids, ties at the k-th value included
        order = torch.sort(row[candidates], descending=True, stable=True).indices[:k]
        values.append(row[candidates[order]].tolist())
        ids.append(candidates[order].tolist())
    return values, ids
