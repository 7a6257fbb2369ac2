# Set-up from a bare Python 3.11 with pip: `make demo` and `make test` create .venv themselves.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast test-gpu bench-sim compile-cuda clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m meshcomm.tools.demo

test: $(STAMP)
	$(PY) -m pytest -q -x --timeout=600 tests

test-fast: $(STAMP)
	$(PY) -m pytest -q -x -m "not slow and not mpi" tests

test-gpu: $(STAMP)
	$(PY) -m pytest -q -m gpu tests

bench-sim: $(STAMP)
	$(VENV)/bin/meshcomm bench sim

compile-cuda:
	$(PY) -m meshcomm.cuda.build --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
