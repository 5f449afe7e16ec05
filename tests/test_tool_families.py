"""Each family's tool-call syntax (``app/pipeline/tools/syntax.py``): found from the makers' chat templates
(``tests/templates/``), read back out of replies in any split, forced by the grammar with the family's marker
tokens as tokens, and end to end over HTTP on tiny models whose vocabularies and templates are each family's:
the markers the model writes as special tokens reach the parser, calls are never left in the content, every call
has a name and arguments that parse, and earlier calls and tool results go back through the family's template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from test_tools import parse as parse_split

from app.pipeline.tools import ToolCalling
from app.pipeline.tools.grammar import tool_grammar
from app.pipeline.tools.parser import ToolCallParser
from app.pipeline.tools.syntax import DEFAULT, HERMES, LLAMA3, MISTRAL, UNSUPPORTED, ToolSyntax, detect
from tests.app_helpers import LOCAL

TEMPLATES = Path(__file__).parent / "templates"


def template(name: str) -> str:
    return (TEMPLATES / f"{name}.jinja").read_text()


@pytest.mark.parametrize(
    ("name", "family", "native"),
    [("qwen2.5", "hermes", True), ("qwen3", "hermes", True), ("llama3.1", "llama3", True),
     ("mistral-nemo", "mistral", True), ("qwen3-coder", "qwen-xml", True), ("qwen3.5", "qwen-xml", True),
     ("granite-4.0", "hermes", True), ("glm-4.6", "unsupported", False), ("r1-distill-qwen", "hermes", False),
     ("lfm2", "pythonic", True), ("lfm2.5", "pythonic", True), ("gemma-4", "gemma", True)],
)  # fmt: skip
def test_each_template_s_family_is_found(name: str, family: str, native: bool) -> None:
    added = {"<tool_call>": 7, "</tool_call>": 8, "[TOOL_CALLS]": 9, "<|python_tag|>": 10, "<|tool_call_start|>": 11,
             "<|tool_call>": 12, '<|"|>': 13}  # fmt: skip
    syntax = detect(template(name), added)
    assert (syntax.family, syntax.native) == (family, native)
    if family in ("hermes", "mistral", "llama3", "qwen-xml", "pythonic", "gemma") and native:
        assert syntax.open_id is not None  # the vocabulary's marker token is used as a token
    if family == "gemma":  # ... and its strings' quote mark, kept in the text the parser reads
        assert syntax.quote_id == 13 and 13 in syntax.kept_special


def test_a_template_without_tools_gets_the_default_prompt_and_one_with_an_unknown_syntax_none() -> None:
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}", {}) is DEFAULT
    assert detect("{% if tools %}{{ tools | tojson }}{% endif %}", {}) is UNSUPPORTED


# -- the parser, per family -----------------------------------------------------------------------------------


def written(syntax: ToolSyntax, calls: list[tuple[str, dict[str, Any]]]) -> str:
    """Calls as the family's model writes them; no calls: a plain answer."""
    if not calls:
        return "It is sunny."
    objects = [f'{{"name": {json.dumps(n)}, "{syntax.arguments_key}": {json.dumps(a)}}}' for n, a in calls]
    if syntax.family == "mistral":
        return f"{syntax.open}[{', '.join(objects)}]"
    if syntax.family == "llama3":
        return "; ".join(objects)
    return "\n".join(f"{syntax.open}\n{o}\n{syntax.close}" for o in objects)


def parse(syntax: ToolSyntax, text: str, splits: list[int]) -> tuple[ToolCallParser, str, list[dict[str, Any]]]:
    parser, pieces, deltas = parse_split(text, splits, syntax)
    return parser, "".join(pieces), deltas


json_values = st.recursive(
    st.none() | st.integers() | st.text(alphabet=st.sampled_from('ab{}[];,"\\<>_ é\n'), max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
names = st.from_regex(r"[A-Za-z0-9_-]{1,12}", fullmatch=True)


@settings(max_examples=200, deadline=None)
@given(
    family=st.sampled_from([HERMES, LLAMA3, MISTRAL]),
    calls=st.lists(st.tuples(names, st.dictionaries(st.text(max_size=4), json_values, max_size=3)), max_size=3),
    data=st.data(),
)
def test_each_family_s_calls_come_back_whole_in_any_split(family: ToolSyntax, calls: list, data: st.DataObject) -> None:
    text = written(family, calls)
    splits = data.draw(st.lists(st.integers(0, len(text)), max_size=8))
    parser, content, deltas = parse(family, text, splits)
    got = [(call.name, json.loads(call.arguments)) for call in parser.calls]
    assert got == [(n, a) for n, a in calls]
    assert content == ("" if calls else text) and all(call.name for call in parser.calls)
    ids = [delta["id"] for delta in deltas if "id" in delta]
    if family is MISTRAL:  # as its template requires
        assert all(len(i) == 9 and i.isalnum() for i in ids)


def xml_written(calls: list[tuple[str, dict[str, Any]]], before: str = "") -> str:
    """Calls as Qwen3-Coder and Qwen3.5 write them (their template's spelling of each value: a string as it is,
    anything else as JSON)."""
    blocks = []
    for name, arguments in calls:
        values = "".join(f"<parameter={key}>\n{value if isinstance(value, str) else json.dumps(value)}\n</parameter>\n"
                         for key, value in arguments.items())  # fmt: skip
        blocks.append(f"<tool_call>\n<function={name}>\n{values}</function>\n</tool_call>")
    return before + "\n".join(blocks)


xml_values = st.one_of(
    st.text(alphabet=st.sampled_from('ab<>/="\\{} é\n'), max_size=12).filter(lambda t: "</" not in t),
    st.integers(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.tuples(names, st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), xml_values,
                                                    max_size=3)), max_size=3),
    before=st.sampled_from(["", "Let me look.\n\n"]),
    data=st.data(),
)  # fmt: skip
def test_xml_calls_come_back_whole_and_typed_by_their_schema_in_any_split(calls: list, before: str,
                                                                          data: st.DataObject) -> None:  # fmt: skip
    """Qwen3-Coder's and Qwen3.5's calls: each value typed as its tool's schema types it (a string as the text,
    the others as the JSON they spell), the streamed fragments the whole arguments, the text before them content."""
    from app.pipeline.tools.xml_parser import XmlCallParser

    types: dict[str, dict[str, str]] = {}
    for name, arguments in calls:  # one schema a tool (a name called twice types its keys alike)
        for key, value in arguments.items():
            kind = "string" if isinstance(value, str) else "object"
            assume(types.setdefault(name, {}).setdefault(key, kind) == kind)
    text = xml_written(calls, before)
    splits = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser, pieces, deltas, start = XmlCallParser(types), [], [], 0
    for end in [*splits, len(text)]:
        piece, more = parser.feed(text[start:end])
        pieces.append(piece)
        deltas += more
        start = end
    rest, more = parser.finish()
    got = {}
    for delta in [*deltas, *more]:
        got[delta["index"]] = got.get(delta["index"], "") + delta["function"].get("arguments", "")
    assert [got[i] for i in sorted(got)] == [call.arguments for call in parser.calls]
    assert [(call.name, json.loads(call.arguments)) for call in parser.calls] == [(n, a) for n, a in calls]
    assert "".join(pieces) + rest == before


def test_an_xml_call_cut_short_keeps_what_it_has_and_text_that_is_no_call_is_content() -> None:
    from app.pipeline.tools.xml_parser import XmlCallParser

    parser = XmlCallParser({"f": {"n": "integer"}})
    parser.feed("<tool_call>\n<function=f>\n<parameter=n>\n4")
    parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [("f", {"n": 4})]
    parser = XmlCallParser()
    text = "Use <tool_call> tags like <b>this</b>."
    assert parser.feed(text)[0] + parser.finish()[0] == text and not parser.calls


python_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab(),=[]{}"\\\' é\n'), max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.tuples(names.map(lambda n: n.replace("-", "_")).filter(str.isidentifier),
                             st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), python_values, max_size=3)),
                   max_size=3),
    python=st.booleans(),
    data=st.data(),
)  # fmt: skip
def test_lfm2_s_calls_come_back_whole_in_any_split(calls: list, python: bool, data: st.DataObject) -> None:
    """LFM2's blocks of calls, values as JSON (``true``, ``null``) or as Python writes them (``True``, ``None``,
    single quotes), names that are Python's keywords too (a tool ``import``, a parameter ``from``): each call's
    arguments the values, the text around the block content."""
    from app.pipeline.tools.pythonic_parser import CLOSE, OPEN, PythonicCallParser, call_text

    block = call_text(calls) if calls else ""
    if python and calls:  # Python's spelling of the same values
        body = ", ".join(f"{n}({', '.join(f'{k}={v!r}' for k, v in a.items())})" for n, a in calls)
        block = f"{OPEN}[{body}]{CLOSE}"
    text = f"Let me look. {block} Done."
    splits = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser, pieces, deltas, start = PythonicCallParser(), [], [], 0
    for end in [*splits, len(text)]:
        piece, more = parser.feed(text[start:end])
        pieces.append(piece)
        deltas += more
        start = end
    rest, _ = parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [(n, a) for n, a in calls]
    assert [json.loads(d["function"]["arguments"]) for d in deltas] == [a for _, a in calls]
    assert "".join(pieces) + rest == ("Let me look.  Done." if calls else text)


def test_text_in_lfm2_s_markers_that_is_no_call_is_content_and_nothing_runs() -> None:
    from app.pipeline.tools.pythonic_parser import PythonicCallParser

    for block in ("[__import__('os').system('true')]", "[f(x=open('/etc/passwd'))]", "[f(1)]", "[" * 5000):
        parser = PythonicCallParser()
        text = f"<|tool_call_start|>{block}<|tool_call_end|>"
        assert parser.feed(text)[0] + parser.finish()[0] == text and not parser.calls


def gemma_value(value: Any) -> str:
    """A value as Gemma 4's template writes it (``format_argument``: strings between quote marks, keys bare)."""
    if isinstance(value, str):
        return f'<|"|>{value}<|"|>'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ",".join(f"{key}:{gemma_value(item)}" for key, item in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(gemma_value(item) for item in value) + "]"
    return json.dumps(value)


gemma_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.sampled_from('ab{}[]:,"\\<>_ é\n'), max_size=10).filter(lambda t: '<|"|>' not in t),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.from_regex(r"[a-z_]{1,6}", fullmatch=True), inner,
                                                                 max_size=3),
    max_leaves=6,
)  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(st.tuples(names, st.dictionaries(st.from_regex(r"[a-z_]{1,8}", fullmatch=True), gemma_values,
                                                    max_size=3)), max_size=3),
    data=st.data(),
)  # fmt: skip
def test_gemma_4_s_calls_come_back_whole_in_any_split(calls: list, data: st.DataObject) -> None:
    """Gemma 4's blocks, one a call, values in its notation (strings between ``<|"|>`` marks with any text in them,
    bare keys, nested arrays and objects, numbers, ``true``, ``null``): each call's arguments the values, the text
    around the blocks content."""
    from app.pipeline.tools.gemma_parser import CLOSE, OPEN, GemmaCallParser

    blocks = "".join(f"{OPEN}call:{n}{gemma_value(a)}{CLOSE}" for n, a in calls)
    text = f"Let me look. {blocks} Done."
    splits = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    parser, pieces, deltas, start = GemmaCallParser(), [], [], 0
    for end in [*splits, len(text)]:
        piece, more = parser.feed(text[start:end])
        pieces.append(piece)
        deltas += more
        start = end
    rest, _ = parser.finish()
    assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == [(n, a) for n, a in calls]
    assert [json.loads(d["function"]["arguments"]) for d in deltas] == [a for _, a in calls]
    assert "".join(pieces) + rest == ("Let me look.  Done." if calls else text)


def test_text_in_gemma_4_s_markers_that_is_no_call_is_content() -> None:
    from app.pipeline.tools.gemma_parser import GemmaCallParser

    for block in ("call:f", "f{a:1}", "call:{a:1}", 'call:f{a:<|"|>open}', "call:f{a:1}x", "call:f" + "[" * 5000):
        parser = GemmaCallParser()
        text = f"<|tool_call>{block}<tool_call|>"
        assert parser.feed(text)[0] + parser.finish()[0] == text and not parser.calls


def test_llama3_text_that_is_not_a_call_is_content() -> None:
    for text in ('{"answer": 42}', "Paris is sunny.", '  {"nam', "{"):
        parser, content, _ = parse(LLAMA3, text, [2])
        assert content == text and not parser.calls


# -- the grammars: markers as tokens ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's vocabulary with the families' markers added as special tokens."""
    from engine.core.tokenizer import HFTokenizer
    from engine.runtime import loader
    from engine.runtime.gguf_tokenizer import convert

    hf = convert(loader._default_gguf())
    hf.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>", "[TOOL_CALLS]",
                                                         "<|python_tag|>"]})  # fmt: skip
    return HFTokenizer(hf, frozenset({2}))


def allowed(matcher, token: int) -> bool:
    mask = np.frombuffer(matcher.allowed_tokens(), dtype=np.uint32)
    return bool(mask[token // 32] >> (token % 32) & 1)


def test_marker_tokens_are_forced_as_tokens_and_their_spelling_is_refused(tokenizer) -> None:
    from app.wire.openai.messages import Tool
    from engine.core.grammar import Grammars

    tool = Tool.model_validate({"type": "function", "function": {"name": "now"}})
    grammars = Grammars(tokenizer)
    for family in (HERMES, MISTRAL):
        syntax = detect(family.open + ' {"name"' + (family.close or ""), tokenizer.added)
        assert syntax.open_id == tokenizer.added[family.open]
        matcher = grammars.matcher(grammars.lark(tool_grammar(ToolCalling((tool,), "required"), syntax)))
        assert allowed(matcher, syntax.open_id)
        assert not any(allowed(matcher, t) for t in tokenizer.encode(family.open[0], False))  # not as text
        auto = grammars.matcher(grammars.lark(tool_grammar(ToolCalling((tool,), "auto"), syntax)))
        for token in tokenizer.encode("Let me see. ", False):
            assert allowed(auto, token)
            auto.accept(token)
        assert allowed(auto, syntax.open_id)


# -- over HTTP, on tiny models with each family's vocabulary and template ------------------------------------------

FAMILIES = {  # the template, and SmolLM2's special tokens renamed to the family's (id 1: BOS, 2: EOS)
    "qwen2.5": {1: "<|im_start|>", 2: "<|im_end|>", 3: "<tool_call>", 4: "</tool_call>"},
    "llama3.1": {1: "<|begin_of_text|>", 2: "<|eot_id|>", 3: "<|start_header_id|>", 4: "<|end_header_id|>",
                 5: "<|python_tag|>", 6: "<|eom_id|>"},
    "mistral-nemo": {1: "<s>", 2: "</s>", 3: "[INST]", 4: "[/INST]", 5: "[TOOL_CALLS]", 6: "[AVAILABLE_TOOLS]",
                     7: "[/AVAILABLE_TOOLS]", 8: "[TOOL_RESULTS]", 9: "[/TOOL_RESULTS]"},
    "qwen3.5": {1: "<|im_start|>", 2: "<|im_end|>", 3: "<tool_call>", 4: "</tool_call>", 5: "<think>", 6: "</think>"},
    "glm-4.6": {1: "[gMASK]", 2: "<|user|>", 3: "<|assistant|>", 4: "<tool_call>", 5: "</tool_call>"},
    "lfm2": {1: "<|im_start|>", 2: "<|im_end|>", 3: "<|tool_call_start|>", 4: "<|tool_call_end|>",
             5: "<|tool_list_start|>", 6: "<|tool_list_end|>", 7: "<|tool_response_start|>",
             8: "<|tool_response_end|>"},
    "gemma-4": {1: "<bos>", 2: "<turn|>", 3: "<|turn>", 4: "<|tool_call>", 5: "<tool_call|>", 6: '<|"|>',
                7: "<|tool_response>", 8: "<tool_response|>", 9: "<|channel>", 10: "<channel|>", 11: "<|tool>",
                12: "<tool|>", 13: "<|think|>"},
}  # fmt: skip
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module", params=["qwen2.5", "llama3.1", "mistral-nemo", "qwen3.5", "lfm2", "gemma-4"])
def family_client(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    yield from _client(request.param, tmp_path_factory)


def _client(name: str, tmp_path_factory: pytest.TempPathFactory):
    from gguf import GGMLQuantizationType as T
    from gguf_files import tiny_model, write_gguf
    from starlette.testclient import TestClient

    from app.server.app import create_app
    from app.server.state import ServerConfig
    from engine.chooser import build
    from engine.core.config import EngineConfig
    from engine.runtime import loader

    root = tmp_path_factory.mktemp(name)
    path = root / f"tiny-{name}.gguf"
    types = {kind: T.Q8_0 for kind in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    model = tiny_model("llama", vocab=49152, seed=3)
    write_gguf(model, "llama", path, loader._default_gguf(), types, renamed=FAMILIES[name], template=template(name))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SMOLSERVE_CACHE_DIR", str(root / "cache"))
        served = build(EngineConfig(model=str(path), kv_cache_gib=0.25, max_model_len=1024, embedding_model="none"))
    with TestClient(create_app(served, ServerConfig()), base_url=LOCAL) as client:
        yield (_NoThinking(client) if name == "qwen3.5" else client), served, name


class _NoThinking:
    """Qwen3.5's client: its chat requests with the template's thinking off (``enable_thinking: false``), as a
    client that wants calls without reasoning asks (with it on, the calls come after the reasoning:
    ``test_a_reasoning_model_s_calls_come_after_its_reasoning``)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def post(self, url: str, json: dict[str, Any], **kwargs: Any) -> Any:
        return self.client.post(url, json=self._body(url, json), **kwargs)

    def stream(self, method: str, url: str, json: dict[str, Any], **kwargs: Any) -> Any:
        return self.client.stream(method, url, json=self._body(url, json), **kwargs)

    @staticmethod
    def _body(url: str, body: dict[str, Any]) -> dict[str, Any]:
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        return {**body, **off} if url.endswith("/chat/completions") else body


def chat(client, **body: Any) -> dict[str, Any]:
    response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def marker_id(served, name: str) -> int:
    markers = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call_start|>", "<|tool_call>")
    return next(i for i, text in FAMILIES[name].items() if text in markers)


def assert_calls_whole(choice: dict[str, Any]) -> list[dict[str, Any]]:
    """Every call has the tool's name and arguments that parse to the tool's schema; no syntax left in content."""
    calls = choice["message"].get("tool_calls") or []
    for call in calls:
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "get_weather" and set(arguments) == {"city", "unit"}
    content = choice["message"]["content"] or ""
    markers = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '"name"', "<|tool_call_start|>", "get_weather(",
               "<|tool_call>", "call:get_weather")  # fmt: skip
    assert not any(marker in content for marker in markers)
    return calls


def test_required_and_named_calls_come_in_the_family_s_syntax(family_client) -> None:
    client, served, name = family_client
    for choice in (
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
    ):
        got = chat(client, temperature=0, max_tokens=80, logprobs=True, parallel_tool_calls=False, **choice)
        calls = assert_calls_whole(got)
        assert got["finish_reason"] == "tool_calls" and calls and got["message"]["content"] is None
        first = got["logprobs"]["content"][0]["token"]
        if name != "llama3.1":  # the marker came as its token (llama3's forced call is the bare JSON)
            assert first == FAMILIES[name][marker_id(served, name)]
        if name == "mistral-nemo":
            assert all(len(call["id"]) == 9 and call["id"].isalnum() for call in calls)


def test_auto_reads_a_call_the_model_starts_with_its_marker_token(family_client) -> None:
    """With the marker token pushed up (a random model rarely calls on its own), the call it starts is read from
    token ids whose text the detokenizer would drop: a call, never content."""
    client, served, name = family_client
    bias = {str(marker_id(served, name)): 100}
    got = chat(client, temperature=0, max_tokens=80, logit_bias=bias, parallel_tool_calls=False)
    assert assert_calls_whole(got) and got["finish_reason"] == "tool_calls"
    plain = chat(client, temperature=0, max_tokens=8, tool_choice="none", logit_bias=bias)
    assert "tool_calls" not in plain["message"] and plain["finish_reason"] == "length"


def test_streamed_calls_assemble_to_the_whole_answer(family_client) -> None:
    client, _, _ = family_client
    whole = chat(client, temperature=0, max_tokens=80, tool_choice="required", parallel_tool_calls=False)
    body = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 80, "tool_choice": "required",
            "parallel_tool_calls": False, "stream": True}  # fmt: skip
    calls: list[dict[str, str]] = []
    content, finish = "", None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                if "id" in delta:
                    calls.append({"name": delta["function"]["name"], "arguments": ""})
                calls[delta["index"]]["arguments"] += delta["function"].get("arguments", "")
            finish = choice["finish_reason"] or finish
    expected = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                for c in whole["message"]["tool_calls"]]  # fmt: skip
    assert calls == expected and content == "" and finish == "tool_calls"


def test_a_tool_result_goes_back_through_the_family_s_template(family_client) -> None:
    """The client's ids (not Mistral's 9 characters) and arguments as a JSON string: rendered as the template
    writes a call and its result, and the conversation goes on."""
    client, served, name = family_client
    call = {"id": "call_5f1b2c3d4e5f60718293a4b5", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}  # fmt: skip
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": "18 C, sunny"}]  # fmt: skip
    tokens = client.post("/tokenize", json={"messages": messages, "tools": [WEATHER]}).json()["tokens"]
    text = served.tokenizer.decode(tokens, skip_special_tokens=False)
    expected = {
        "qwen2.5": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
        "llama3.1": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}<|eot_id|>',
        "mistral-nemo": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}, "id": "',
        "qwen3.5": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\nC"
        "\n</parameter>\n</function>\n</tool_call>",
        "lfm2": '<|tool_call_start|>[get_weather(city="Paris", unit="C")]<|tool_call_end|><|im_end|>\n'
        "<|im_start|>tool\n<|tool_response_start|>18 C, sunny<|tool_response_end|>",
        "gemma-4": '<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>C<|"|>}<tool_call|>'
        '<|tool_response>response:get_weather{value:<|"|>18 C, sunny<|"|>}<tool_response|>',
    }[name]
    assert expected in text and "18 C, sunny" in text
    got = chat(client, messages=messages, temperature=0, max_tokens=4)
    assert got["finish_reason"] in ("length", "stop", "tool_calls")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**31), temperature=st.sampled_from([0.0, 0.7, 1.5]), mode=st.sampled_from(["required", "auto"])
)
def test_no_call_has_an_empty_name_or_arguments_that_do_not_parse(family_client, seed: int, temperature: float,
                                                                   mode: str) -> None:  # fmt: skip
    client, served, name = family_client
    bias = {str(marker_id(served, name)): 30} if mode == "auto" else None
    got = chat(client, tool_choice=mode, seed=seed, temperature=temperature, max_tokens=120, logit_bias=bias)
    if got["finish_reason"] == "tool_calls":
        assert assert_calls_whole(got)
    for call in got["message"].get("tool_calls") or []:
        assert call["function"]["name"] == "get_weather"


def test_a_reasoning_model_s_calls_come_after_its_reasoning(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Qwen3.5's template opens the reasoning in the prompt (``<think>``): a required call is held to the grammar
    only after the reasoning's closing tag (pushed up here: a random model rarely closes it), never forced inside
    it, where it would be read as reasoning; with thinking off, at once."""
    for client, served, _ in _client("qwen3.5", tmp_path_factory):
        closing = served.tokenizer.added["</think>"]
        body = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 80, "tool_choice": "required",
                "parallel_tool_calls": False, "logit_bias": {str(closing): 100}}  # fmt: skip
        got = client.client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert assert_calls_whole(got) and got["finish_reason"] == "tool_calls"
        assert not got["message"].get("reasoning_content")
        plain = client.client.post("/v1/chat/completions", json={**body, "logit_bias": {}, "max_tokens": 12})
        choice = plain.json()["choices"][0]  # unclosed, the reasoning runs on: no call forced into it
        assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
        assert "<tool_call>" not in (choice["message"].get("reasoning_content") or "")


def test_gemma_4_s_calls_come_after_its_thought_channel(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Gemma 4 with thinking on (``enable_thinking``: its prompt does not close the channel): a reply that opens
    its thought channel reasons there, its calls held to the grammar only after ``<channel|>`` (both pushed up
    here); unclosed, the reasoning runs on, read as reasoning, no call forced into it."""
    for client, served, _ in _client("gemma-4", tmp_path_factory):
        opening, closing = (served.tokenizer.added[tag] for tag in ("<|channel>", "<channel|>"))
        body = {"messages": ASK, "tools": [WEATHER], "temperature": 0, "max_tokens": 80, "tool_choice": "required",
                "parallel_tool_calls": False, "chat_template_kwargs": {"enable_thinking": True},
                "logit_bias": {str(opening): 100, str(closing): 100}}  # fmt: skip
        got = client.post("/v1/chat/completions", json=body).json()["choices"][0]
        assert assert_calls_whole(got) and got["finish_reason"] == "tool_calls"
        plain = client.post("/v1/chat/completions", json={**body, "logit_bias": {str(opening): 100}, "max_tokens": 12})
        choice = plain.json()["choices"][0]
        assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
        assert choice["message"].get("reasoning_content") and not choice["message"].get("content")
        assert "<|channel>" not in choice["message"]["reasoning_content"]


def test_tools_for_a_template_whose_syntax_cannot_be_read_are_a_400(tmp_path_factory: pytest.TempPathFactory) -> None:
    for client, _, _ in _client("glm-4.6", tmp_path_factory):
        response = client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
        assert response.status_code == 400 and response.json()["error"]["param"] == "tools"
        assert "syntax" in response.json()["error"]["message"]
        plain = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2})
        assert plain.status_code == 200


def test_a_hermes_call_without_its_marker_is_a_call_when_it_is_the_whole_reply() -> None:
    """Qwen2.5-Coder writes its calls as bare JSON when the choice is its own: read as a call, held to the tool's
    schema by ``auto``'s grammar; a reply that only mentions one later is text."""
    bare = '{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    parser, content, _ = parse(HERMES, bare, [5, 17])
    assert [(c.name, c.arguments) for c in parser.calls] == [("get_weather", '{"city": "Paris"}')] and content == ""
    parser, content, _ = parse(HERMES, "Use " + bare, [3])
    assert not parser.calls and content == "Use " + bare


def whole_reply_allowed(grammars, grammar: str, text: str) -> bool:
    """Whether ``text`` then the end is a reply ``grammar`` allows (one byte a token)."""
    from engine.core.tokenizer import ByteTokenizer

    matcher = grammars.matcher(grammar)
    for token in [*text.encode(), ByteTokenizer.EOS]:
        if not allowed(matcher, token):
            return False
        matcher.accept(token)
    return True


def test_auto_holds_a_bare_call_to_the_schema() -> None:
    from app.wire.openai.messages import Tool
    from engine.core.grammar import Grammars
    from engine.core.tokenizer import ByteTokenizer

    grammars = Grammars(ByteTokenizer())
    tool = Tool.model_validate(WEATHER)
    for syntax in (HERMES, LLAMA3, DEFAULT):
        grammar = grammars.lark(tool_grammar(ToolCalling((tool,), "auto"), syntax))
        key = syntax.arguments_key
        call = f'{{"name": "get_weather", "{key}": {{"city": "Paris", "unit": "C"}}}}'
        assert whole_reply_allowed(grammars, grammar, call)
        assert not whole_reply_allowed(grammars, grammar, f'{{"name": "get_time", "{key}": {{}}}}')  # not offered
        assert not whole_reply_allowed(grammars, grammar, '{"answer": 42}')  # a reply that begins { is a call
        assert whole_reply_allowed(grammars, grammar, "It is sunny in Paris.")


def test_a_bare_call_in_a_json_code_fence_is_a_call() -> None:
    """Qwen2.5-Coder's other habit: the object in a code fence. Read as a call, and held to the schema."""
    from app.wire.openai.messages import Tool
    from engine.core.grammar import Grammars
    from engine.core.tokenizer import ByteTokenizer

    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n```'
    parser, content, _ = parse(HERMES, fenced, [2, 9, 30])
    got = [(c.name, json.loads(c.arguments)) for c in parser.calls]
    assert got == [("get_weather", {"city": "Paris", "unit": "C"})] and content == ""
    grammars = Grammars(ByteTokenizer())
    for syntax in (HERMES, LLAMA3):
        grammar = grammars.lark(tool_grammar(ToolCalling((Tool.model_validate(WEATHER),), "auto"), syntax))
        assert whole_reply_allowed(grammars, grammar, fenced.replace("arguments", syntax.arguments_key))
        assert not whole_reply_allowed(grammars, grammar, '```json\n{"answer": 1}\n```')
        assert whole_reply_allowed(grammars, grammar, "```python\nprint(1)\n```")
