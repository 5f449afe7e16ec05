"""The tokenizer interface the scheduler and HTTP layer use, and its two implementations. Torch-free."""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Render chat messages with the model's template, ending where the assistant's reply begins."""
        ...


class HFTokenizer:
    """Wraps a HuggingFace tokenizer instance (loaded elsewhere) behind the small interface above."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._tok = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = len(hf_tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if not self._tok.chat_template:
            raise ValueError("this model has no chat template")
        text = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        # The template writes the special tokens out as text; encoding must not add more.
        return list(self._tok.encode(text, add_special_tokens=False))


class ByteTokenizer:
    """One token per UTF-8 byte, plus an end-of-sequence token. For the fake engine and its tests."""

    EOS = 256

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({self.EOS})
        self.vocab_size = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int]) -> str:
        return bytes(t for t in token_ids if t < 256).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")
