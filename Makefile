# `make demo` and `make test` work on a fresh machine: they create .venv with a
# Python >= 3.12 (found even where `python3` is older) and install the package.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?= -q -n 2

.PHONY: demo test venv clean

$(PY):
	@set -e; best=""; \
	for c in python3.13 python3.12 python3 \
	    $$(ls -d $${PYENV_ROOT:-$$HOME/.pyenv}/versions/3.1[2-9]*/bin/python3 2>/dev/null) \
	    /usr/local/bin/python3.1[2-9] /usr/bin/python3.1[2-9]; do \
	  if command -v $$c >/dev/null 2>&1 && $$c -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then best=$$c; break; fi; \
	done; \
	if [ -z "$$best" ]; then echo "error: hydrajax needs Python >= 3.12; none found" >&2; exit 1; fi; \
	echo "creating $(VENV) with $$best ($$($$best --version))"; \
	$$best -m venv $(VENV); \
	$(PY) -m pip install -q --upgrade pip; \
	$(PY) -m pip install -q -e '.[test]'

venv: $(PY)

demo: $(PY)
	$(PY) -m experiments.demo

test: $(PY)
	$(PY) -m pytest $(PYTEST_ARGS) tests

clean:
	rm -rf $(VENV)
