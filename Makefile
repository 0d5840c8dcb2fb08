# Two entry points that set up everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.genrec-installed

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on the dev/CI machines this is a local CPU wheel; a bare `torch`
	# requirement would otherwise resolve to a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

.PHONY: install test demo lint
install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(VENV)/bin/genrec demo

lint: $(STAMP)
	$(VENV)/bin/ruff check platform tests deployments jobs
