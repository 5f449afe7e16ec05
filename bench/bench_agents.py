"""Coding agents' turns on smolserve and on llama.cpp's server, the same GGUF (by default the Qwen2.5-Coder-0.5B
Q4_K_M of ``../shared/tools/user-models.sh``), both up together and measured in turn, from each agent's first
request as recorded from the agent itself (``tests/fixtures/agents/``: Codex over the Responses API, Qwen Code and
OpenCode over chat completions, Claude Code over the Messages API), sent to each server's own endpoint for it.

Per agent and server: the **first turn** (its whole system prompt and tools from nothing: a fresh nonce opens the
system prompt, so no cache holds any of it) and a **later turn** (the same conversation, the model's reply and a
new user message after it: what a prefix cache keeps is not read again). Each turn generates at most ``--tokens``
greedy tokens; wall seconds of the whole answer.

    .venv/bin/python bench/bench_agents.py --llama-server "$(../shared/tools/build-llama-server.sh)"
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from llama import start_llama  # noqa: E402

from compat.conftest import start_server, stop_server  # noqa: E402

USER_MODELS = ROOT.parent / "shared" / "tools" / "user-models.sh"
FIXTURES = ROOT / "tests" / "fixtures" / "agents"
AGENTS = ("codex", "qwen-code", "opencode", "claude-code")


def opened(body: dict[str, Any], path: str, nonce: str) -> dict[str, Any]:
    """The body with ``nonce`` before its system prompt: nothing of it is in any cache."""
    body = copy.deepcopy(body)
    tag = f"[session {nonce}]\n"
    if path.endswith("/responses"):
        body["instructions"] = tag + (body.get("instructions") or "")
    elif path.endswith("/messages"):
        system = body.get("system") or ""
        body["system"] = tag + system if isinstance(system, str) else [{"type": "text", "text": tag}, *system]
    else:
        messages = body["messages"]
        if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
            messages[0]["content"] = tag + messages[0]["content"]
        else:
            messages.insert(0, {"role": "system", "content": tag})
    return body


def later(body: dict[str, Any], path: str, reply: str) -> dict[str, Any]:
    """The next turn: the model's reply, then a new user message."""
    body = copy.deepcopy(body)
    turn: list[dict[str, Any]] = [
        {"role": "assistant", "content": reply or "ok"},
        {"role": "user", "content": "Now reply with the single word: goodbye"},
    ]
    if path.endswith("/responses"):  # items as Codex sends them (llama.cpp's server needs their type)
        turn = [{"type": "message", **item} for item in turn]
    key = "input" if path.endswith("/responses") else "messages"
    body[key] = [*body[key], *turn]
    return body


def limited(body: dict[str, Any], path: str, model: str, tokens: int) -> dict[str, Any]:
    body = {**body, "model": model, "stream": False, "temperature": 0}
    for key in ("max_tokens", "max_output_tokens", "max_completion_tokens", "stream_options"):
        body.pop(key, None)
    body["max_output_tokens" if path.endswith("/responses") else "max_tokens"] = tokens
    return body


def reply_text(answer: dict[str, Any], path: str) -> str:
    if path.endswith("/responses"):
        return "".join(p.get("text", "") for item in answer.get("output", []) for p in item.get("content") or [])
    if path.endswith("/messages"):
        return "".join(block.get("text", "") for block in answer.get("content", []))
    return answer["choices"][0]["message"].get("content") or ""


def turn(client: httpx.Client, base: str, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = client.post(base + path, json=body, headers={"Authorization": "Bearer none", "x-api-key": "none"})
    seconds = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"{base}{path}: {response.status_code} {response.text[:300]}")
    return seconds, response.json()


def measure(servers: dict[str, str], agent: str, model: str, tokens: int) -> dict[str, tuple[float, float]]:
    fixture = json.loads((FIXTURES / f"{agent}.json").read_text())
    path = fixture["path"]
    times = {}
    with httpx.Client(timeout=3600) as client:
        for name, base in servers.items():
            first = limited(opened(fixture["body"], path, uuid.uuid4().hex), path, model, tokens)
            cold, answer = turn(client, base, path, first)
            warm, _ = turn(client, base, path, later(first, path, reply_text(answer, path)))
            times[name] = (cold, warm)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the GGUF (default: the Qwen file of user-models.sh)")
    parser.add_argument("--llama-server", required=True, help="llama.cpp's llama-server binary")
    parser.add_argument("--agents", nargs="+", default=list(AGENTS), choices=AGENTS)
    parser.add_argument("--tokens", type=int, default=16, help="tokens each turn generates at most")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    gguf = Path(args.gguf or subprocess.run(["bash", str(USER_MODELS)], capture_output=True, text=True,
                                            check=True).stdout.strip())  # fmt: skip
    ours, ours_base = start_server("--model", str(gguf), "--embedding-model", "none", "--kv-cache-gib", "2")
    llama, llama_base = start_llama(args.llama_server, 1, 32768, args.threads, ["--jinja"], gguf)
    try:
        print(f"{'agent':<12} {'server':<10} {'first turn s':>12} {'later turn s':>12}")
        for agent in args.agents:
            times = measure({"smolserve": ours_base, "llama.cpp": llama_base}, agent, gguf.stem, args.tokens)
            for name, (cold, warm) in times.items():
                print(f"{agent:<12} {name:<10} {cold:>12.1f} {warm:>12.1f}", flush=True)
            ratio = times["smolserve"][0] / times["llama.cpp"][0]
            print(f"{agent:<12} {'ratio':<10} {ratio:>11.2f}x {times['smolserve'][1] / times['llama.cpp'][1]:>11.2f}x")
    finally:
        stop_server(ours)
        stop_server(llama)


if __name__ == "__main__":
    main()
