# Two entry points on a fresh machine: `make run` (the main job on the embedded default) and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pinned: this wheel is on disk as a CPU build; any other torch request downloads a multi-GB CUDA build
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test bench-step clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)"
	$(BIN)/pip install -q -e ".[test]"
	touch $@

run: $(BIN)/.installed
	$(BIN)/mesh up

test: $(BIN)/.installed
	$(BIN)/python -m pytest

bench-step: $(BIN)/.installed
	$(BIN)/mesh bench step

clean:
	rm -rf $(VENV) build *.egg-info
