# Everything a user or CI runs. Each target installs what it needs into $(VENV) first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?=
# Test workers (pytest-xdist; tests/conftest.py groups the tests).
TEST_WORKERS ?= 2

# Local server settings (README "Quick start"). MODEL_REPOSITORY: one to serve as it is; TARGET: the decoder
# `make serve` renders (python-ort, onnxruntime from ORT_BACKEND, null); URL: a running server for bench/verify.
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
MIMI_WEIGHTS ?=
MODEL_REPOSITORY ?=
TARGET ?=
URL ?=

# vLLM-Omni in an environment of its own: importing it patches vLLM and torch (tests/test_vllm_omni.py).
VLLM_VENV ?= build/vllm-omni-venv
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: venv vllm-omni-venv lint test serve export bench bench-duplex bench-memory bench-failover record verify clean

venv: $(STAMP)
vllm-omni-venv: $(VLLM_STAMP)

$(VLLM_STAMP): requirements/vllm-omni.txt pyproject.toml
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -r requirements/vllm-omni.txt
	$(VLLM_VENV)/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
	touch $(VLLM_STAMP)

$(STAMP): pyproject.toml requirements/constraints.txt server/ort_backend.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --disable-pip-version-check -c requirements/constraints.txt -e '.[export,client,serve,test]'
	# moshi, the tests' streaming reference, pins torch<2.10 in its metadata.
	$(PIP) install --quiet --disable-pip-version-check --no-deps moshi==0.2.13
	# ONNX Runtime's library for Triton's native ORT backend, pinned by sha256.
	$(BIN)/python -m mimi_code2wav.server.ort_backend
	touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

test: $(STAMP) $(VLLM_STAMP)
	VLLM_OMNI_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder $(PYTEST_ARGS)

export: $(STAMP)
	$(BIN)/code2wav-export build $(if $(MIMI_WEIGHTS),--weights $(MIMI_WEIGHTS),)

serve: $(STAMP)
	$(BIN)/code2wav-server serve --metrics-port $(METRICS_PORT) --http-port $(HTTP_PORT) --grpc-port $(GRPC_PORT) $(if $(MIMI_WEIGHTS),--weights $(MIMI_WEIGHTS),) $(if $(MODEL_REPOSITORY),--model-repository $(MODEL_REPOSITORY),) $(if $(TARGET),--decoder $(TARGET),)

# Benchmark $(1) of the python-ort decoder, then (local server only) of the null one into bench_results/$(2):
# the front's ceiling. Both run; the target fails if either did.
bench_both = status=0; $(BIN)/python -m benchmarks $(1) $(if $(URL),--url $(URL),) || status=1; \
	$(if $(URL),,$(BIN)/python -m benchmarks $(1) --decoder null --out-dir bench_results/$(2) || status=1;) exit $$status

bench: $(STAMP)
	$(call bench_both,sweep,null)

# Conversations ticking together every 80 ms (per-frame, ramp 1+5, catch-up).
bench-duplex: $(STAMP)
	$(call bench_both,duplex,duplex-null)

# The native decoder's memory (python-ort leaves its memory to ONNX Runtime's arena; TARGET=python-ort for it).
bench-memory: $(STAMP)
	$(BIN)/python -m benchmarks memory --decoder $(or $(TARGET),onnxruntime)

# docker-compose.cpu.yml's 3 replicas, the busiest SIGKILLed under 12 streams: what staying and moving streams
# feel. As root; MIMI_WEIGHTS here is a checkpoint file or folder (no hub id), else seeded random weights.
bench-failover: $(STAMP)
	$(BIN)/python -m benchmarks failover $(if $(MIMI_WEIGHTS),--weights $(MIMI_WEIGHTS),)

# docs/benchmarks.md and the README's headline from docs/benchmarks/*.json; ADD=run.json records that run first.
record: $(STAMP)
	$(BIN)/python -m benchmarks record $(if $(ADD),--add $(ADD),)

verify: $(STAMP)
	$(BIN)/code2wav-server verify $(if $(MIMI_WEIGHTS),--weights $(MIMI_WEIGHTS),) $(if $(URL),--url $(URL),)

clean:
	rm -rf build .pytest_cache
