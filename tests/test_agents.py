"""Each coding agent end to end, headless, against a server of the user's GGUF (``USER_GGUF``), through a recording
proxy (``tests/agent_proxy.py``): `make test-agents`, not part of `make test` (each agent needs npm's package and
minutes of CPU). An agent runs when its binary is named: ``CODEX`` (``@openai/codex``), ``QWEN_CODE``
(``@qwen-code/qwen-code``), ``OPENCODE`` (``opencode-ai``), ``CLAUDE_CODE`` (``@anthropic-ai/claude-code``).

Each agent gets a one-word task and a tool task (run ``ls``). What is asserted is what the server saw and answered:
every request answered 200; the one-word task answered with text; in the tool task the model's calls came back
with their results (each call id the server answered is in a later request, as the API's result of that call);
not what the 0.5B model chose to do with them (a run where it chose no call, or where the agent stopped on what it
did, a tool the agent refuses or a conversation grown past the context, is an expected failure, named)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_proxy import Exchange, RecordingProxy

pytestmark = pytest.mark.user_model
#: A call id as each API answers it: OpenAI's (chat and responses), Anthropic's.
_CALL_ID = re.compile(r"\b(?:call_[0-9a-f]{24}|toolu_[0-9a-f]{32})\b")
_TIMEOUT = 1800  # a cold first turn of 13,000 prompt tokens on two cores takes minutes


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    path = os.environ.get("USER_GGUF")
    if not path:
        pytest.skip("USER_GGUF names no file (make test-agents sets it)")
    from compat.conftest import start_server, stop_server

    proc, base = start_server("--model", path, "--embedding-model", "none", "--kv-cache-gib", "2")
    yield base
    stop_server(proc)


def model_name() -> str:
    return Path(os.environ["USER_GGUF"]).stem


def binary(variable: str) -> str:
    found = os.environ.get(variable)
    if not found:
        pytest.skip(f"{variable} names no binary")
    return found


def results_sent_back(value: Any) -> set[str]:
    """Call ids the agent sent results for: chat's ``tool`` messages, Responses' ``function_call_output`` items,
    Anthropic's ``tool_result`` blocks, anywhere in the bodies."""
    if isinstance(value, list):
        return set().union(*map(results_sent_back, value)) if value else set()
    if not isinstance(value, dict):
        return set()
    found = set().union(*map(results_sent_back, value.values())) if value else set()
    if value.get("role") == "tool":
        found.add(value.get("tool_call_id"))
    elif value.get("type") in ("function_call_output", "custom_tool_call_output"):
        found.add(value.get("call_id"))
    elif value.get("type") == "tool_result":
        found.add(value.get("tool_use_id"))
    return found


def run_tasks(proxy: RecordingProxy, run: Callable[[str], None], agent: str,
              task: str = "Run the shell command `ls` with your tool and tell me the file names.") -> None:  # fmt: skip
    """The one-word task, then the tool task; the server's side of each checked. With ``AGENT_FIXTURES`` naming a
    folder, the agent's first turn (its largest request) is written there as a fixture (``tests/fixtures/agents/``)."""
    run("Reply with the single word: hello")
    one = proxy.generations()
    if os.environ.get("AGENT_FIXTURES") and one:  # its turn: the largest request (a title's is small)
        turn = max(one, key=lambda e: len(json.dumps(e.body)))
        fixture = {"agent": agent, "path": turn.path, "body": turn.body}
        (Path(os.environ["AGENT_FIXTURES"]) / f"{agent}.json").write_text(json.dumps(fixture, indent=2) + "\n")
    assert one and all(e.status == 200 for e in one), [(e.path, e.status, e.text[:300]) for e in one]
    assert any(len(e.text) > 50 for e in one)
    start = len(proxy.exchanges)
    stopped = None
    try:
        run(task)
    except AssertionError as exc:  # the agent gave up on what the 0.5B model did (checked below: not the server)
        stopped = str(exc)[-300:]
    task = [e for e in proxy.exchanges[start:] if e in proxy.generations()]
    assert task and all(e.status == 200 or _outgrew(e) for e in task), [(e.path, e.status, e.text[:300]) for e in task]
    answered = {call for e in task for call in _CALL_ID.findall(e.text)}
    missing = answered - results_sent_back([e.body for e in task])
    assert len(missing) <= 1, missing  # the last call may be the one the agent stopped at (its turn limit)
    if stopped is not None:  # every request answered, each call's result taken back: the model's doing
        pytest.xfail(f"{agent}: the agent stopped on the model's turn ({len(answered)} calls answered): {stopped}")
    if not answered:  # the model's choice, not the server's: every request was still answered
        pytest.xfail(f"{agent}: the model made no tool call this run (nothing of the round trip to check)")


def _outgrew(exchange: Exchange) -> bool:
    """A 400 for a conversation the model's own turns grew past its context (what llama.cpp's server refuses too)."""
    return exchange.status == 400 and "maximum context length" in exchange.text


def _run(command: list[str], env: dict[str, str], cwd: Path) -> None:
    done = subprocess.run(command, env={**os.environ, **env}, cwd=cwd, capture_output=True, text=True,
                          timeout=_TIMEOUT, stdin=subprocess.DEVNULL)  # fmt: skip
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])


def workspace(tmp_path: Path) -> Path:
    folder = tmp_path / "work"
    folder.mkdir()
    (folder / "hello.py").write_text("print('hi')\n")
    return folder


def test_codex_cli(server: str, tmp_path: Path) -> None:
    """Codex over the Responses API (``wire_api = "responses"``; its request: ``fixtures/agents/codex.json``)."""
    codex = binary("CODEX")
    home, cwd = tmp_path / "codex-home", workspace(tmp_path)
    home.mkdir()
    with RecordingProxy(server) as proxy:
        (home / "config.toml").write_text(
            f'model = "{model_name()}"\nmodel_provider = "smolserve"\n\n[model_providers.smolserve]\n'
            f'name = "smolserve"\nbase_url = "{proxy.base}/v1"\nwire_api = "responses"\nenv_key = "SMOLSERVE_KEY"\n'
        )
        env = {"CODEX_HOME": str(home), "SMOLSERVE_KEY": "none"}
        run_tasks(proxy, lambda task: _run([codex, "exec", "--json", "--skip-git-repo-check", task], env, cwd), "codex")


def test_qwen_code(server: str, tmp_path: Path) -> None:
    """Qwen Code over chat completions (its request: ``fixtures/agents/qwen-code.json``; ``max_tokens`` 32,768 on
    a 32,768-token model every turn: clamped)."""
    qwen = binary("QWEN_CODE")
    cwd = workspace(tmp_path)
    with RecordingProxy(server) as proxy:
        env = {"HOME": str(tmp_path), "OPENAI_BASE_URL": f"{proxy.base}/v1", "OPENAI_API_KEY": "none",
               "OPENAI_MODEL": model_name()}  # fmt: skip
        run_tasks(
            proxy, lambda task: _run([qwen, "--auth-type", "openai", "--yolo", "-p", task], env, cwd), "qwen-code"
        )


def test_opencode(server: str, tmp_path: Path) -> None:
    """OpenCode over chat completions (Vercel's AI SDK; its request: ``fixtures/agents/opencode.json``)."""
    opencode = binary("OPENCODE")
    cwd = workspace(tmp_path)
    with RecordingProxy(server) as proxy:
        config = {"$schema": "https://opencode.ai/config.json", "model": f"smolserve/{model_name()}",
                  "provider": {"smolserve": {"npm": "@ai-sdk/openai-compatible", "name": "smolserve",
                                             "options": {"baseURL": f"{proxy.base}/v1", "apiKey": "none"},
                                             "models": {model_name(): {"name": model_name()}}}}}  # fmt: skip
        (tmp_path / "opencode.json").write_text(json.dumps(config))
        env = {"OPENCODE_CONFIG": str(tmp_path / "opencode.json")}
        command = [opencode, "run", "--model", f"smolserve/{model_name()}"]
        run_tasks(proxy, lambda task: _run([*command, task], env, cwd), "opencode")


def test_claude_code(server: str, tmp_path: Path) -> None:
    """Claude Code over the Messages API (its request: ``fixtures/agents/claude-code.json``)."""
    claude = binary("CLAUDE_CODE")
    cwd = workspace(tmp_path)
    with RecordingProxy(server) as proxy:
        env = {"ANTHROPIC_BASE_URL": proxy.base, "ANTHROPIC_API_KEY": "none", "ANTHROPIC_MODEL": model_name(),
               "ANTHROPIC_DEFAULT_HAIKU_MODEL": model_name(), "ANTHROPIC_SMALL_FAST_MODEL": model_name(),
               "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
               "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512"}  # fmt: skip
        run_tasks(
            proxy,
            lambda task: _run([claude, "-p", task, "--allowedTools", "Bash(ls:*)"], env, cwd),
            "claude-code",
            "Run the command ls with the Bash tool and tell me the file names.",
        )
