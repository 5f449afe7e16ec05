"""Ollama's official JavaScript library (npm ``ollama``, installed by ``make install`` where npm is) against the
session's server on the bundled models: ``compat/ollama_js/client.mjs`` makes each call as an app would, and its
answers are checked here: version, listings, show (the file's keys), chat whole and streamed, generate with its
context sent back, a JSON schema, tools and a tool result, embeddings, a model made by create, Ollama's 404."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Where ``make install`` puts the library (``npm install --prefix``).
MODULES = Path(os.environ.get("OLLAMA_JS_PREFIX", ROOT / ".venv" / "node")) / "node_modules"


def test_the_javascript_library_s_calls_are_answered_as_ollama_answers_them(server_url: str) -> None:
    if shutil.which("node") is None or not (MODULES / "ollama").is_dir():
        pytest.skip(f"node and the ollama library ({MODULES / 'ollama'}, make install) are needed")
    run = subprocess.run(["node", str(ROOT / "compat" / "ollama_js" / "client.mjs"), server_url,
                          "SmolLM2-135M-Instruct", "all-MiniLM-L6-v2"], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OLLAMA_JS_MODULES": str(MODULES)})  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert tuple(map(int, out["version"].split("."))) >= (0, 13, 4)
    assert "SmolLM2-135M-Instruct:latest" in out["listed"]
    assert "completion" in out["show"]["capabilities"] and out["show"]["family"] == "llama"
    assert out["show"]["info"]["llama.block_count"] == 30
    chat = out["chat"]
    assert chat["whole"] == chat["streamed"] and chat["whole"] and chat["eval_count"] <= 8
    assert out["generate"]["prompt_eval_count"] > out["generate"]["context"] > 0
    assert isinstance(out["format"]["color"], str)
    for call in out["tools"]["calls"]:  # the 135M model may answer in words; a call it makes is whole
        assert call["function"]["name"] == "get_weather" and isinstance(call["function"]["arguments"], dict)
    assert out["tools"].get("answered", True) is True
    assert all(abs(norm - 1) < 1e-3 for norm in out["embed"])
    assert out["create"] == "success" and out["made"] == 3
    assert out["error"] == {"status": 404, "message": "model 'no-such-model' not found"}
