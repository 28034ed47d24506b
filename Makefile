# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv (Python >= 3.11) and install bso with its dev extras first.
VENV ?= .venv
PYTHON ?= python3
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

.PHONY: install demo test lint
install: $(STAMP)

demo: $(STAMP)
	$(BIN)/bso demo

# The project's own folders: a script of the user's own in the checkout is not linted.
LINTED := bso client examples scripts tests workers

lint: $(STAMP)
	$(BIN)/ruff check $(LINTED)
	$(BIN)/ruff format --check $(LINTED)
	$(BIN)/mypy

test: lint
	$(BIN)/pytest
