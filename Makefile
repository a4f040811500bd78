# grafana-client's HTTP stack (niquests) brings urllib3-future, whose wheel replaces the real
# urllib3 package at every interpreter start, which breaks requests-based tools (schemathesis);
# built from source with URLLIB3_NO_OVERRIDE=1 it installs beside urllib3 instead.
# Everything installs into .venv in this checkout. CPU torch comes from torch==2.13.0 (a
# local file on the project's CPU machines; on GPU machines the same pin takes the normal
# CUDA wheel). Override with `make TORCH_SPEC=... install`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_SPEC ?= torch==2.13.0
PIP := $(BIN)/python -m pip --disable-pip-version-check --quiet
STAMP := $(VENV)/.installed

.PHONY: install models serve test test-fast lint bench clean prometheus peer

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install "$(TORCH_SPEC)"
	URLLIB3_NO_OVERRIDE=1 $(PIP) install --no-binary urllib3-future -e '.[test]'
	# The q4k kernel, built for this CPU now rather than in the first model actor (~15 s).
	$(BIN)/python -c "from specdec.model.formats import q4k; q4k.available() or print('q4k kernel: not built here; the int8 formats stand in')"
	touch $(STAMP)

install: $(STAMP)

models: install
	$(BIN)/specdec models fetch all

# Runs the service on its embedded default: the offline Qwen pair on CPU, OpenAI-compatible
# HTTP on 127.0.0.1:8000 (serve_config.yaml). Ctrl-C stops it.
# Serve's upkeep at 1 s instead of 0.1 s: on a small machine its control loop and metric
# exports otherwise steal enough CPU to slow every decode step (see deployments/launch.py).
# Ray's workers (the model shards) at the default priority, not nice 15: beside any other busy
# process they would get ~3% of a core each.
SERVE_ENV := RAY_SERVE_CONTROL_LOOP_INTERVAL_S=1 RAY_SERVE_METRICS_EXPORT_INTERVAL_MS=1000 \
	RAY_worker_niceness=0

# `specdec wait-ready` prints each start-up phase and a READY line once a request is served
# at full speed (Serve's own "ready" comes earlier, when only the HTTP router is up).
serve: install
	$(BIN)/specdec models fetch qwen-pair
	PATH="$(CURDIR)/$(BIN):$$PATH" $(SERVE_ENV) exec $(BIN)/specdec serve serve_config.yaml

lint: install
	$(BIN)/ruff check specdec deployments specdec_cli specdec_bench specdec_tools scripts tests

# A real Prometheus for the dashboard test (Debian's package; the service is not started).
prometheus:
	@command -v prometheus >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus; }

# The whole suite, as CI runs it: unit, real-model and integration tests.
test: models lint prometheus
	$(BIN)/python -m pytest -q -ra

# Inner loop: tiny fixture models only (seconds).
test-fast: install
	$(BIN)/python -m pytest -q -m "not real_model and not integration"

bench: models
	$(BIN)/specdec bench core

# The CPU peer, llama.cpp's llama-server and llama-bench, built from the source vendored in
# the llama-cpp-python sdist (no binary wheels exist); about 15 minutes on 2 cores. Not part
# of `make test`. `specdec bench served` adds its rows from peers/llama/build/bin, and
# `specdec bench serve --peer` runs it beside the service at every concurrency.
# Built without llama.cpp's AMX matmul: on an AMX Xeon (Sapphire Rapids class) this version's
# ggml_backend_amx_mul_mat segfaults on the first batch of more than one token, so the server
# dies in its warm-up; without AMX its AVX512 repacked kernels decode as fast (llama-bench
# tg32 17.2 tokens/s there, against 12.4 with repacking off). A no-op on CPUs without AMX.
LLAMA_CPP_VERSION ?= 0.3.36
PEER_DIR := peers/llama
PEER_CFLAGS ?= -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
peer: $(PEER_DIR)/build/bin/llama-server

$(PEER_DIR)/build/bin/llama-server:
	mkdir -p $(PEER_DIR)
	$(PYTHON) -m pip download --disable-pip-version-check --quiet --no-deps --no-binary :all: \
		-d $(PEER_DIR) llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar xzf $(PEER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(PEER_DIR)
	cmake -S $(PEER_DIR)/llama_cpp_python-$(LLAMA_CPP_VERSION)/vendor/llama.cpp \
		-B $(PEER_DIR)/build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_OPENSSL=OFF \
		-DCMAKE_C_FLAGS="$(PEER_CFLAGS)" -DCMAKE_CXX_FLAGS="$(PEER_CFLAGS)"
	cmake --build $(PEER_DIR)/build -j$$(nproc) --target llama-server llama-bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
