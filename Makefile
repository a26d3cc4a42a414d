# Everything a user or CI runs. Each target installs what it needs into $(VENV) first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP := $(BIN)/python -m pip
PYTEST_ARGS ?=
# Test workers (pytest-xdist; tests/conftest.py groups the tests).
TEST_WORKERS ?= 2

# Local server settings (see README "Quick start").
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
MIMI_WEIGHTS ?=
# A model repository to serve as it is (default: export and render the local one for TARGET).
MODEL_REPOSITORY ?=
# The decoder target `make serve` renders: python-ort (default: any machine), onnxruntime (Triton's native
# ONNX Runtime backend from ORT_BACKEND, default ../shared/triton-onnxruntime-backend), null (silence).
TARGET ?=
# A running server for `make bench` / `make verify` (host:gRPC port); bench starts its own without it.
URL ?=

# vLLM-Omni 0.30.0 and this project's plugin, in an environment of their own: importing vLLM-Omni patches
# vLLM and torch, so the tests run its stage in a subprocess of this interpreter (tests/test_vllm_omni.py).
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
	# moshi is the independent streaming reference for tests only; its metadata pins torch<2.10.
	$(PIP) install --quiet --disable-pip-version-check --no-deps moshi==0.2.13
	# ONNX Runtime 1.19.2's library for Triton's native ORT backend (server/ort_backend.py pins it by sha256).
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

# The python-ort decoder's sweep into bench_results/, then (local server only) the same sweep with the
# null decoder into bench_results/null/: the front's ceiling. Both run; the target fails if either did.
bench: $(STAMP)
	status=0; \
	$(BIN)/python -m benchmarks sweep $(if $(URL),--url $(URL),) || status=1; \
	$(if $(URL),,$(BIN)/python -m benchmarks sweep --decoder null --out-dir bench_results/null || status=1;) \
	exit $$status

# Conversations ticking together every 80 ms (per-frame, ramp 1+5, catch-up): the python-ort decoder into
# bench_results/duplex/, then (local server only) the null decoder into bench_results/duplex-null/.
bench-duplex: $(STAMP)
	status=0; \
	$(BIN)/python -m benchmarks duplex $(if $(URL),--url $(URL),) || status=1; \
	$(if $(URL),,$(BIN)/python -m benchmarks duplex --decoder null --out-dir bench_results/duplex-null || status=1;) \
	exit $$status

# The native decoder's memory (Triton's ONNX Runtime backend from ORT_BACKEND; python-ort, the development
# decoder, leaves its memory to ONNX Runtime's arena): TARGET=python-ort measures that one instead.
bench-memory: $(STAMP)
	$(BIN)/python -m benchmarks memory --decoder $(or $(TARGET),onnxruntime)

# The compose scale profile on this host's Docker engine (docker-compose.cpu.yml: 3 CPU replicas behind
# nginx), 12 paced resumable streams, SIGKILL of the busiest replica's tritonserver: what the streams
# that kept their replica feel, and the stall of those that moved (bench_results/failover/). As root;
# MIMI_WEIGHTS here is a checkpoint file or folder (no hub id), else seeded random weights.
bench-failover: $(STAMP)
	$(BIN)/python -m benchmarks failover $(if $(MIMI_WEIGHTS),--weights $(MIMI_WEIGHTS),)

# docs/benchmarks.md and the README's headline table from docs/benchmarks/*.json; with ADD=path/to/run.json
# (bench_results/bench.json, memory.json, ...) that run is recorded first, replacing the previous one of its kind.
record: $(STAMP)
	$(BIN)/python -m benchmarks record $(if $(ADD),--add $(ADD),)

verify: $(STAMP)
	$(BIN)/code2wav-server verify $(if $(MIMI_WEIGHTS),--weights $(MIMI_WEIGHTS),) $(if $(URL),--url $(URL),)

clean:
	rm -rf build .pytest_cache
