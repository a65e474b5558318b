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

.PHONY: demo test lint docs gpu gpu-wheels
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

# The GPU check (docs/development.md). On a GPU machine, which reaches no package index and has
# torch + CUDA but neither torchdata nor orjson: `make gpu` installs the wheels `make
# gpu-wheels` fetched here (carry gpu-wheels/ along), puts this checkout on the path (nothing
# is built) and runs benchmarks/gpu_check.py: the report goes to $(GPU_REPORT_DIR)/report.md.
# `make gpu DEVICE=cpu GPU_PYTHON=.venv/bin/python` is the dry run the test suite makes.
GPU_PYTHON ?= python3
DEVICE ?= cuda
GPU_WHEELS := torchdata orjson
# A wheel with no scripts or data is a zip laid out as site-packages: where a Python has no pip,
# unpacking it is its install.
gpu:
	rm -rf .gpu-site
	if [ "$(DEVICE)" = cuda ] && ls gpu-wheels/*.whl >/dev/null 2>&1; then \
	  $(GPU_PYTHON) -m pip install --quiet --no-deps --no-index --target .gpu-site gpu-wheels/*.whl \
	  || for w in gpu-wheels/*.whl; do $(GPU_PYTHON) -m zipfile -e $$w .gpu-site; done; \
	elif [ "$(DEVICE)" = cuda ]; then \
	  echo "no gpu-wheels/*.whl: run 'make gpu-wheels' where PyPI is reachable, carry gpu-wheels/"; fi
	PYTHONPATH=$(CURDIR)/.gpu-site:$(CURDIR) $(GPU_PYTHON) -m benchmarks.gpu_check --device $(DEVICE)

gpu-wheels: $(BIN)/.installed-dev   # CPython 3.12, manylinux x86-64: what the GPU machines run
	$(BIN)/python -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 \
	  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d gpu-wheels $(GPU_WHEELS)
