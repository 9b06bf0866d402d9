# Every target sets up what it needs: a fresh clone runs `make demo` or `make test` directly.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test lint zoo clean

BASE   := $(VENV)/.installed-base

# The venv is (re)built when missing or when the dependency files change: onnx-gtco alone for the demo, with its
# test tools and the model zoo's torch for the tests.
$(BASE): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e .
	touch $(BASE)

$(STAMP): $(BASE) requirements-zoo.txt
	$(PY) -m pip install --quiet -e '.[test]' -r requirements-zoo.txt
	touch $(STAMP)

install: $(STAMP)

demo: $(BASE)
	$(VENV)/bin/onnx-gtco demo

test: $(STAMP)
	$(VENV)/bin/ruff check onnx_gtco tests tools
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -n 2 --dist loadfile --durations=25

lint: $(STAMP)
	$(VENV)/bin/ruff check onnx_gtco tests tools
	$(VENV)/bin/lint-imports

zoo: $(STAMP)
	$(PY) tools/export_zoo.py

clean:
	rm -rf $(VENV) gtco-demo .pytest_cache .ruff_cache
