"""Fill-in-the-middle: which tokens a model's vocabulary has for it, and the prompt in its family's order.

A coder model trained for FIM reads the code before and after a gap, marked by its own special tokens, and writes
the middle, ending it with one of its end tokens. The families, by how their vocabularies spell the tokens:

- Qwen2.5-Coder: ``<|fim_prefix|>``, ``<|fim_suffix|>``, ``<|fim_middle|>``; ends ``<|endoftext|>``,
  ``<|fim_pad|>``, ``<|repo_name|>``, ``<|file_sep|>``; repository context under ``<|repo_name|>`` and
  ``<|file_sep|>``;
- StarCoder (and its descendants): ``<fim_prefix>``, ``<fim_suffix>``, ``<fim_middle>``; ends ``<|endoftext|>``,
  ``<fim_pad>``, ``<file_sep>``; context under ``<reponame>`` and ``<file_sep>``;
- CodeLlama: ``▁<PRE>``, ``▁<SUF>``, ``▁<MID>``; ends ``▁<EOT>``;
- DeepSeek-Coder: ``fim▁begin``, ``fim▁hole``, ``fim▁end`` between full-width bars.

The prompt is llama.cpp's (``format_prompt_infill`` in its server, the repository-level pattern of Qwen2.5-Coder's
report): ``[repo]myproject\\n [file_sep]name\\n text ... [file_sep]filename\\n`` for the extra context where the
vocabulary has those tokens (else each chunk after a ``--- snippet ---`` line), then ``[prefix] prefix prompt
[suffix] suffix [middle]``. Torch-free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FimFamily:
    name: str
    prefix: str
    suffix: str
    middle: str
    #: What ends the middle besides the model's end of sequence (any of them found in the vocabulary).
    ends: tuple[str, ...]
    repo: str | None = None
    file_sep: str | None = None


FAMILIES = (
    FimFamily("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>",
              ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"), "<|repo_name|>", "<|file_sep|>"),
    FimFamily("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>",
              ("<|endoftext|>", "<fim_pad>", "<file_sep>"), "<reponame>", "<file_sep>"),
    FimFamily("codellama", "\u2581<PRE>", "\u2581<SUF>", "\u2581<MID>", ("\u2581<EOT>",)),
    FimFamily("deepseek-coder", "<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>",
              "<\uff5cfim\u2581end\uff5c>", ("<\uff5cend\u2581of\u2581sentence\uff5c>",)),
)  # fmt: skip
#: The separator of llama.cpp's extra context where the vocabulary has no file separator.
SNIPPET = "\n\n--- snippet ---\n\n"


@dataclass(frozen=True, slots=True)
class Fim:
    """A vocabulary's FIM tokens, by id."""

    family: str
    prefix: int
    suffix: int
    middle: int
    ends: frozenset[int]
    repo: int | None = None
    file_sep: int | None = None


def find(vocab: Mapping[str, int]) -> Fim | None:
    """The FIM tokens of the first family whose prefix, suffix and middle tokens are all in ``vocab``."""
    for family in FAMILIES:
        ids = [vocab.get(token) for token in (family.prefix, family.suffix, family.middle)]
        if None in ids:
            continue
        prefix, suffix, middle = ids
        ends = frozenset(vocab[token] for token in family.ends if token in vocab)
        repo = vocab.get(family.repo) if family.repo else None
        file_sep = vocab.get(family.file_sep) if family.file_sep else None
        return Fim(family.name, prefix, suffix, middle, ends, repo, file_sep)  # type: ignore[arg-type]
    return None


@dataclass(frozen=True, slots=True)
class Infill:
    """What to fill: the text before the gap and after it, ``prompt`` the text the gap's line starts with (it goes
    after the prefix, as llama.cpp puts its ``prompt``), and other files' text as context (``(filename, text)``)."""

    prefix: str
    suffix: str
    prompt: str = ""
    extra: Sequence[tuple[str, str]] = ()


def layout(
    fim: Fim, encode: Callable[[str], list[int]], infill: Infill, bos: Sequence[int] = (), room: int | None = None,
    repository: bool = False,
) -> list[int]:  # fmt: skip
    """The token ids of ``infill`` in llama.cpp's order; ``encode`` tokenizes text without adding special tokens;
    ``bos``: what the model's prompts start with (its BOS where it adds one). ``room``: at most this many tokens,
    taken as llama.cpp takes them: the end of the prefix (up to 3/4 of the room), the start of the suffix, then
    the end of the extra context in what is left (None: everything). ``repository``: the repository header even
    without extra context, as llama.cpp's ``/infill`` writes it (the plain layout otherwise, as the model cards
    give it)."""
    prefix, suffix, typed = encode(infill.prefix), encode(infill.suffix), encode(infill.prompt)
    context = _context(fim, encode, infill.extra, repository)
    if room is not None:
        fixed = len(bos) + 3 + len(typed)  # BOS, the three markers and the gap's line
        prefix = prefix[max(0, len(prefix) - max(0, 3 * room // 4 - fixed)) :]
        suffix = suffix[: max(0, room - fixed - len(prefix))]
        left = max(0, room - fixed - len(prefix) - len(suffix))
        context = context[len(context) - min(left, len(context)) :]
    return [*context, *bos, fim.prefix, *prefix, *typed, fim.suffix, *suffix, fim.middle]


def _context(
    fim: Fim, encode: Callable[[str], list[int]], extra: Sequence[tuple[str, str]], repository: bool
) -> list[int]:
    """Other files' text before the FIM prefix: under the repository tokens where the vocabulary has them."""
    if not extra and not repository:
        return []
    context = [fim.repo, *encode("myproject\n")] if fim.repo is not None else []
    for filename, text in extra:
        context += [fim.file_sep, *encode(f"{filename}\n")] if fim.file_sep is not None else encode(SNIPPET)
        context += encode(text)
    if fim.file_sep is not None:
        context += [fim.file_sep, *encode("filename\n")]
    return context
