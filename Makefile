# Two entry points on a fresh machine: `make run` (the main job on the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pinned: this wheel is on disk as a CPU build; any other torch request downloads a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test deps bench-step clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

run: $(BIN)/.installed
	$(BIN)/mesh up

# the status-page test drives headless Chromium (Debian's `chromium`); installed once, as root, if missing
deps:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get update -q && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium; } || \
	  echo "deps: chromium is missing and could not be installed (needs root and apt-get); the browser test will skip"

test: $(BIN)/.installed deps
	$(BIN)/python -m pytest

bench-step: $(BIN)/.installed
	$(BIN)/mesh bench step

clean:
	rm -rf $(VENV) build *.egg-info
