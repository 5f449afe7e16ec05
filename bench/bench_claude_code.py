"""Claude Code headless against smolserve's and llama.cpp's Messages APIs (``/v1/messages``), on the same GGUF
(by default the Qwen2.5-Coder-0.5B-Instruct Q4_K_M of ``../shared/tools/user-models.sh``): both servers up
together, measured in turn. Per server: the first turn of a fresh conversation (the whole prompt, Claude Code's
system prompt and tools, prefilled from nothing), then a second turn of the same conversation (``--resume``: its
prompt repeats the first's, which a prefix cache keeps), wall time of ``claude -p`` and the usage it reports.

    .venv/bin/python bench/bench_claude_code.py --claude "$(command -v claude)" \
        --llama-server "$(../shared/tools/build-llama-server.sh)"
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from llama import start_llama  # noqa: E402

from compat.conftest import start_server, stop_server  # noqa: E402

USER_MODELS = ROOT.parent / "shared" / "tools" / "user-models.sh"
FIRST = "Reply with the single word: hello"
SECOND = "Now reply with the single word: goodbye"


def claude(binary: str, base: str, model: str, workdir: Path, *args: str) -> tuple[float, dict]:
    """One ``claude -p`` run against ``base``: its wall seconds and its JSON result."""
    env = {**os.environ, "ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "none", "ANTHROPIC_MODEL": model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "ANTHROPIC_SMALL_FAST_MODEL": model,
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1",
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "512"}  # fmt: skip
    started = time.perf_counter()
    done = subprocess.run([binary, "-p", *args, "--output-format", "json"], env=env, cwd=workdir,
                          capture_output=True, text=True, timeout=1800)  # fmt: skip
    seconds = time.perf_counter() - started
    try:
        return seconds, json.loads(done.stdout)
    except ValueError:
        return seconds, {"is_error": True, "result": (done.stdout + done.stderr)[-300:]}


def conversation(binary: str, base: str, model: str) -> list[tuple[str, float, dict]]:
    """A first turn, then a second turn of the same session."""
    with tempfile.TemporaryDirectory() as tmp:
        first_s, first = claude(binary, base, model, Path(tmp), FIRST)
        session = first.get("session_id")
        rows = [("first turn", first_s, first)]
        if session:
            rows.append(("second turn", *claude(binary, base, model, Path(tmp), "--resume", session, SECOND)))
        return rows


def row(server: str, turn: str, seconds: float, result: dict) -> str:
    usage = result.get("usage") or {}
    prompt = sum(usage.get(key) or 0 for key in ("input_tokens", "cache_read_input_tokens",
                                                 "cache_creation_input_tokens"))  # fmt: skip
    answer = str(result.get("result", ""))[:40].replace("\n", " ").replace("|", "/")
    return (f"| {server} | {turn} | {seconds:.1f} | {prompt} | {usage.get('cache_read_input_tokens', 0)} | "
            f"{usage.get('output_tokens', 0)} | {'error' if result.get('is_error') else 'ok'}: {answer} |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--claude", required=True, help="Claude Code's claude binary")
    parser.add_argument("--llama-server", default=None, help="llama.cpp's llama-server; none: smolserve alone")
    parser.add_argument("--gguf", type=Path, default=None)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    gguf = args.gguf or Path(subprocess.run(["bash", str(USER_MODELS)], capture_output=True, text=True,
                                            check=True).stdout.strip().splitlines()[-1])  # fmt: skip
    ours, ours_base = start_server("--model", str(gguf), "--embedding-model", "none", "--kv-cache-gib", "2")
    servers = [("smolserve", ours_base)]
    theirs = None
    if args.llama_server:
        theirs, theirs_base = start_llama(args.llama_server, 1, args.context, gguf=gguf, extra=["--jinja"])
        servers.append(("llama.cpp", theirs_base))
    try:
        print("| server | turn | seconds | prompt tokens | read from cache | output tokens | answer |")
        print("|---|---|---|---|---|---|---|")
        for name, base in servers:
            for turn, seconds, result in conversation(args.claude, base, gguf.stem):
                print(row(name, turn, seconds, result), flush=True)
    finally:
        stop_server(ours)
        if theirs is not None:
            theirs.terminate()
            theirs.wait()


if __name__ == "__main__":
    main()
