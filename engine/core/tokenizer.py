"""The tokenizer interface the scheduler and HTTP layer use, and its two implementations. Torch-free."""

from __future__ import annotations

from typing import Any, Protocol

from jinja2 import TemplateError

from engine.core import fim
from engine.core.fim import Fim


class ChatTemplateError(ValueError):
    """The model's chat template refused the conversation (its ``raise_exception``); the message says why."""


class NoChatTemplate(ChatTemplateError):
    """The model's files carry no chat template: it takes text prompts only."""


class Tokenizer(Protocol):
    eos_token_ids: frozenset[int]
    vocab_size: int
    #: Most characters one token's spelling holds (special tokens included): text of ``n`` characters other than
    #: white space needs at least ``n / max_token_chars`` tokens, a bound that costs no tokenizing.
    max_token_chars: int
    #: The vocabulary's fill-in-the-middle tokens (``engine/core/fim.py``); None: it has none.
    fim: Fim | None
    #: What ``encode`` puts before a text's tokens (the model's BOS where it adds one).
    start_ids: list[int]
    #: The vocabulary's added tokens (special or not) by spelling: chat markers, tool-call markers, FIM tokens.
    added: dict[str, int]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, a special token's text included; for a byte-level vocabulary a
        token may hold part of a UTF-8 character."""
        ...

    def info(self) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: the special tokens and chat template a client needs to tokenize alike."""
        ...

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """Render chat messages with the model's template, ending where the assistant's reply begins; ``tools``
        go to the template's own ``tools`` argument (for a template that renders them), ``extra`` are more of
        its variables (``enable_thinking``). A template that refuses the conversation raises
        ``ChatTemplateError`` (``NoChatTemplate`` where there is none)."""
        ...


class HFTokenizer:
    """Wraps a HuggingFace tokenizer instance (loaded elsewhere) behind the small interface above."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: frozenset[int]) -> None:
        self._tok = hf_tokenizer
        self.eos_token_ids = eos_token_ids
        self.vocab_size = len(hf_tokenizer)
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._byte_level = type(getattr(backend, "decoder", None)).__name__ == "ByteLevel"
        self._added = frozenset(hf_tokenizer.added_tokens_decoder)  # special and added tokens: text, not bytes
        self.added = {token.content: token_id for token_id, token in hf_tokenizer.added_tokens_decoder.items()}
        self._bytes: dict[int, bytes] = {}
        # A vocabulary entry's spelling is at least as long as the text it decodes to: a byte-level one spells each
        # byte as a character, a SentencePiece one adds its word marker or spells a byte <0xE6>.
        vocab = hf_tokenizer.get_vocab()
        self.max_token_chars = max(map(len, vocab), default=1)
        self.fim = fim.find(vocab)
        bos = hf_tokenizer.bos_token_id
        self.start_ids = [t for t in hf_tokenizer.encode("", add_special_tokens=True) if t == bos]

    @property
    def hf_tokenizer(self) -> Any:
        """The transformers tokenizer, for libraries that read its vocabulary themselves (the grammar engine)."""
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        cached = self._bytes.get(token_id)
        if cached is None:
            cached = self._bytes[token_id] = self._token_bytes(token_id)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        if self._byte_level and token_id not in self._added:
            # A byte-level BPE piece spells its bytes one character each (GPT-2's table): exact also for a piece
            # that holds part of a character, which decode() would turn into U+FFFD.
            piece = self._tok.convert_ids_to_tokens(token_id)
            if all(char in _BYTE_OF for char in piece):
                return bytes(_BYTE_OF[char] for char in piece)
        return self._tok.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def info(self) -> dict[str, Any]:
        tok = self._tok
        return {
            "tokenizer_class": type(tok).__name__,
            "bos_token": tok.bos_token,
            "eos_token": tok.eos_token,
            "pad_token": tok.pad_token,
            "unk_token": tok.unk_token,
            "chat_template": tok.chat_template,
            "vocab_size": self.vocab_size,
        }

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        if not self._tok.chat_template:
            raise NoChatTemplate("this model's files carry no chat template")
        extra = extra or {}
        # A conversation that ends in the assistant's own text (a prefill) is continued, not answered anew.
        opens_turn = not extra.get("continue_final_message")
        try:
            text = self._tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=opens_turn, tokenize=False, **extra
            )
        except TemplateError as exc:  # the template's raise_exception, or a conversation it cannot render
            raise ChatTemplateError(str(exc)) from None
        except TypeError as exc:  # a template variable that is also a parameter of the rendering
            raise ChatTemplateError(f"chat_template_kwargs: {exc}") from None
        # The template writes the special tokens out as text; encoding must not add more.
        return list(self._tok.encode(text, add_special_tokens=False))


class ByteTokenizer:
    """One token per UTF-8 byte, plus an end-of-sequence token. For the fake engine and its tests."""

    EOS = 256

    def __init__(self) -> None:
        self.eos_token_ids = frozenset({self.EOS})
        self.vocab_size = 257
        self.max_token_chars = 1  # a character is one to four tokens
        self.fim: Fim | None = None
        self.start_ids: list[int] = []
        self.added: dict[str, int] = {}

    EOS_TEXT = "<eos>"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return b"".join(self.token_bytes(t) for t in token_ids if t < 256 or not skip_special_tokens).decode(
            "utf-8", errors="replace"
        )

    def token_bytes(self, token_id: int) -> bytes:
        return bytes([token_id]) if token_id < 256 else self.EOS_TEXT.encode()

    def info(self) -> dict[str, Any]:
        return {"tokenizer_class": type(self).__name__, "eos_token": self.EOS_TEXT, "vocab_size": self.vocab_size}

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        return self.encode("".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: ")


def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {chr(char): byte for byte, char in zip(printable, chars, strict=True)}


_BYTE_OF = _byte_table()
