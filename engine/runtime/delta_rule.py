"""The gated delta rule of Qwen3.5's linear-attention layers (Gated DeltaNet), one position at a time, as
transformers' ``torch_recurrent_gated_delta_rule`` computes it: each value head keeps a ``[key dim, value dim]``
matrix ``S``; at each position ``S`` decays by ``exp(g)``, takes the value the key reads from it, moves it toward
the row's value by ``beta`` (``S += k (v - S^T k) beta``), and the query reads it.

Where the native op (``csrc/delta_rule.cpp``) does not build, ``StepStates`` takes a sequence's positions through
``step`` one at a time, one sequence at a time: every call has one shape, so a position's sums run in one order
whatever the step holds, and a prompt cut into chunks computes what it computes whole (each position reads the
matrix the one before it left).
"""

from __future__ import annotations

import torch


def prepare(query: torch.Tensor, key: torch.Tensor, value_heads: int, tiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries and keys ``[rows, key heads, dim]`` (float32, ``l2norm``-ed) as the rule reads them: the query scaled
    by 1/sqrt(dim), each key head repeated for the value heads it serves: grouped (transformers' order: value head j
    reads key head j // r) or ``tiled`` (llama.cpp's converter's order of the value heads: j reads j % key heads)."""
    query = query * query.shape[-1] ** -0.5
    repeats = value_heads // key.shape[1]
    if repeats > 1:
        if tiled:
            query, key = query.repeat(1, repeats, 1), key.repeat(1, repeats, 1)
        else:
            query, key = query.repeat_interleave(repeats, dim=1), key.repeat_interleave(repeats, dim=1)
    return query, key


def step(
    matrix: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, decay: torch.Tensor,
    beta: torch.Tensor, correct: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One position of ``n`` sequences: ``matrix`` ``[n, heads, key dim, value dim]``, ``query``/``key`` ``[n, heads,
    key dim]`` (``prepare``), ``value`` ``[n, heads, value dim]``, ``decay`` (g) and ``beta`` ``[n, heads]``, all
    float32. The matrix after it, and what the query reads ``[n, heads, value dim]``. Without the correction
    (``correct`` False) it is Mamba-2's selective scan: ``S = exp(g) S + k (v beta)^T`` (the key ``B``, the value
    ``x``, beta the step ``dt``, the query ``C``)."""
    matrix = matrix * decay.exp()[..., None, None]
    read = (matrix * key[..., None]).sum(dim=-2) if correct else torch.zeros_like(value)
    delta = (value - read) * beta[..., None]
    matrix = matrix + key[..., None] * delta[..., None, :]
    return matrix, (matrix * query[..., None]).sum(dim=-2)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Each vector of ``x``'s last dimension over its L2 norm, as transformers' (and FLA's) ``l2norm``."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)
