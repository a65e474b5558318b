# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
# Each creates .venv, installs torch==2.13.0 first (a looser spec pulls a multi-GB CUDA
# build), then the package with its extras, then runs.
# pip installs torch (it finds the CPU wheel this machine keeps on disk; uv would download a
# CUDA build); uv installs the rest with torch held at the installed one: ~10 s against pip's
# ~150 s for the dev extra. pip takes over where uv cannot reach the index.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0

$(BIN)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip uv
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/uv pip install --python $(BIN)/python --quiet $(TORCH) -e ".[$*]" \
	  || $(BIN)/python -m pip install --quiet -e ".[$*]"
	touch $@

# mkdocs-material prints a banner about MkDocs 2 on every build; it is not about this site.
export NO_MKDOCS_2_WARNING := 1

.PHONY: demo test lint docs
demo: $(BIN)/.installed-dev
	$(BIN)/python examples/demo.py $(ARGS)

test: $(BIN)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mkdocs build --strict --quiet   # a broken link, a bad docstring: fails (into site/)
	$(BIN)/python -m pytest -n 2 --doctest-modules steplib tests   # 2 workers: ~3.5 min, not ~5.5

docs: $(BIN)/.installed-dev   # build the site and serve it on http://127.0.0.1:8000
	$(BIN)/mkdocs serve

lint: $(BIN)/.installed-dev
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .
