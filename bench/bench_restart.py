"""An agent's long prefix after a restart and after an unload: the prefix cache's disk tier
(``engine/runtime/kv_disk.py``) against prefilling it again.

One coding agent's first turn as recorded from the agent (``tests/fixtures/agents/``; Claude Code's by default:
its system prompt and tools, 18.8k tokens on the Qwen2.5-Coder GGUF), a nonce before its system prompt so nothing
holds it yet, served by smolserve (default flags, a fresh ``--data-dir``):

- **cold**: the first time, from nothing;
- **memory**: again, the prefix in the pool;
- **restart**: again, after the server stopped and started over the same ``--data-dir``;
- **unload**: again, after Ollama's ``keep_alive: 0`` unloaded the model (it loads on the request);
- **no disk** (``--with-baseline``): after a restart with ``--kv-disk-gib 0``, as before the disk tier.

Wall seconds of the whole answer (at most ``--tokens`` greedy tokens), and each against cold.

    .venv/bin/python bench/bench_restart.py --agent claude-code
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_agents import AGENTS, FIXTURES, USER_MODELS, limited, opened, turn  # noqa: E402

from compat.conftest import start_server, stop_server  # noqa: E402


def timed(base: str, path: str, body: dict, client: httpx.Client) -> float:
    started = time.perf_counter()
    turn(client, base, path, body)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="the GGUF (default: the Qwen file of user-models.sh)")
    parser.add_argument("--agent", default="claude-code", choices=AGENTS)
    parser.add_argument("--tokens", type=int, default=16, help="tokens each turn generates at most")
    parser.add_argument("--with-baseline", action="store_true", help="also a restart without the disk tier")
    args = parser.parse_args()
    gguf = Path(args.gguf or subprocess.run(["bash", str(USER_MODELS)], capture_output=True, text=True,
                                            check=True).stdout.strip())  # fmt: skip
    fixture = json.loads((FIXTURES / f"{args.agent}.json").read_text())
    path = fixture["path"]
    body = limited(opened(fixture["body"], path, uuid.uuid4().hex), path, gguf.stem, args.tokens)
    data = tempfile.mkdtemp(prefix="bench-restart-")
    # A second (fake) model makes the first one unloadable, as in a server of several models.
    flags = ("--model", str(gguf), "--model", "fake", "--embedding-model", "none", "--kv-cache-gib", "2",
             "--data-dir", data)  # fmt: skip
    times: dict[str, float] = {}
    with httpx.Client(timeout=3600) as client:
        proc, base = start_server(*flags)
        try:
            times["cold"] = timed(base, path, body, client)
            times["memory"] = timed(base, path, body, client)
        finally:
            stop_server(proc)  # SIGTERM: the blocks queued for disk are written first
        proc, base = start_server(*flags)
        try:
            times["restart"] = timed(base, path, body, client)
            unloaded = client.post(f"{base}/api/generate", json={"model": gguf.stem, "keep_alive": 0}).json()
            if unloaded.get("done_reason") == "unload":
                times["unload"] = timed(base, path, body, client)
        finally:
            stop_server(proc)
        if args.with_baseline:
            proc, base = start_server(*flags, "--kv-disk-gib", "0")
            try:
                times["no disk"] = timed(base, path, body, client)
            finally:
                stop_server(proc)
    print(f"{args.agent}: {'turn':<10} {'seconds':>8} {'x cold':>7}")
    for name, seconds in times.items():
        print(f"{args.agent}: {name:<10} {seconds:>8.1f} {seconds / times['cold']:>7.3f}")


if __name__ == "__main__":
    main()
