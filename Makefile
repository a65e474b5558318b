# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv, installs torch==2.13.0 first (a looser spec pulls a multi-GB CUDA
# build), then the package with its extras, then runs.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

$(BIN)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[$*]"
	touch $@

.PHONY: demo test lint
demo: $(BIN)/.installed-dev
	$(BIN)/python examples/demo.py $(ARGS)

test: $(BIN)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m pytest --doctest-modules steplib tests

lint: $(BIN)/.installed-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
