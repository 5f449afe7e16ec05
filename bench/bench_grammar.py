"""What a grammar costs on the default model's tokenizer: compile time of a new schema, of a repeated one (the
server's cache), and the per-token mask time of one constrained row, for llguidance (what the server uses)
and, when it is importable, xgrammar (the alternative the issue names), on the same schema and token sequence.

    .venv/bin/python bench/bench_grammar.py
    PYTHONPATH=/tmp/xgpkg .venv/bin/python bench/bench_grammar.py   # with xgrammar installed there (--no-deps)

The tokens fed are the default model's tokenization of a valid instance, so every mask is one a real
generation would need. No model is loaded.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app.pipeline.tools import ToolCalling
from app.pipeline.tools.grammar import tool_grammar
from app.pipeline.tools.prompt import call_text
from app.wire.openai.messages import Tool
from engine.core.grammar import JSON_STYLE, Grammars
from engine.core.tokenizer import HFTokenizer
from engine.runtime import loader

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "species": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "vaccinated": {"type": "boolean"},
        "toys": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "species", "age", "vaccinated", "toys"],
    "additionalProperties": False,
}
INSTANCE = {"name": "Whiskers the Third", "species": "cat", "age": 7, "vaccinated": True, "toys": ["mouse", "ball"]}
TOOL = Tool.model_validate({"type": "function", "function": {"name": "describe_pet", "parameters": SCHEMA}})


def tokenizer() -> HFTokenizer:
    from transformers import AutoTokenizer

    _, path = loader._resolve(loader.DEFAULT_MODEL)
    hf = AutoTokenizer.from_pretrained(path)
    return HFTokenizer(hf, frozenset({hf.eos_token_id}))


def reply_ids(tok: HFTokenizer, text: str) -> list[int]:
    """``text`` as the model would generate it, then the end of the reply."""
    return [*tok.encode(text, add_special_tokens=False), min(tok.eos_token_ids)]


def timed(fn: Any) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def llguidance_masks(grammars: Grammars, grammar_text: str, ids: list[int]) -> list[float]:
    matcher = grammars.matcher(grammar_text)
    times = []
    for token in ids:
        started = time.perf_counter()
        mask = np.frombuffer(matcher.allowed_tokens(), dtype=np.uint8)
        times.append(time.perf_counter() - started)
        assert np.unpackbits(mask, bitorder="little")[token], "the instance must be allowed"
        matcher.accept(token)
    return times


def report(name: str, compile_s: float, cached_s: float | None, masks: list[float]) -> None:
    cached = f"{cached_s * 1e3:.3f} ms" if cached_s is not None else "-"
    print(
        f"{name:38s} compile {compile_s * 1e3:8.1f} ms   repeat {cached:>10s}   mask/token: "
        f"median {statistics.median(masks) * 1e6:6.0f} us, mean {statistics.mean(masks) * 1e6:6.0f} us, "
        f"max {max(masks) * 1e6:6.0f} us ({len(masks)} tokens)"
    )


def bench_llguidance(tok: HFTokenizer) -> None:
    grammars = Grammars(tok)
    grammars.matcher(Grammars.regex("x"))  # the tokenizer's one-off set-up (~0.5 s), not a schema's cost
    schema_text = Grammars.json_schema(SCHEMA)
    first = timed(lambda: grammars.matcher(schema_text))
    again = timed(lambda: grammars.matcher(schema_text))
    ids = reply_ids(tok, json.dumps(INSTANCE))
    report("llguidance json_schema", first, again, llguidance_masks(grammars, schema_text, ids))
    for choice in ("required", "auto"):
        calling = ToolCalling((TOOL,), choice)  # type: ignore[arg-type]
        text = tool_grammar(calling)
        assert text is not None
        first = timed(lambda text=text: grammars.matcher(text))
        reply = ("Let me describe it. " if choice == "auto" else "") + call_text("describe_pet", json.dumps(INSTANCE))
        ids = reply_ids(tok, reply)
        report(f"llguidance tool call ({choice})", first, None, llguidance_masks(grammars, text, ids))


def bench_xgrammar(tok: HFTokenizer) -> None:
    try:
        import xgrammar as xgr
    except ImportError:
        print("xgrammar: not importable (pip install --target DIR --no-deps xgrammar apache-tvm-ffi)")
        return
    info = xgr.TokenizerInfo.from_huggingface(tok.hf_tokenizer, vocab_size=tok.vocab_size)
    compiler = xgr.GrammarCompiler(info)
    separators = (JSON_STYLE["item_separator"], JSON_STYLE["key_separator"])
    schema = json.dumps(SCHEMA)
    first = timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False, separators=separators))
    compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=separators)  # its cache
    again = timed(lambda: compiler.compile_json_schema(schema, any_whitespace=False, separators=separators))
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    ids = reply_ids(tok, json.dumps(INSTANCE))
    times = []
    for token in ids:
        started = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask)
        times.append(time.perf_counter() - started)
        assert matcher.accept_token(token), "the instance must be allowed"
    report("xgrammar json_schema", first, again, times)


def main() -> None:
    tok = tokenizer()
    bench_llguidance(tok)
    bench_xgrammar(tok)


if __name__ == "__main__":
    main()
