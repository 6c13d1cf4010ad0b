# The two entry points: `make demo` (install + pretrain the tiny model on the Python
# standard library, then fine-tune, preference-train, RL-train, distil and evaluate it) and `make test` (install + run the test suite); `make check` runs the unit tests alone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ifndef WORKDIR
WORKDIR := runs/tiny-$(shell date +%Y%m%d-%H%M%S)
endif

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(VENV)/bin/lm demo --workdir $(WORKDIR)
	$(VENV)/bin/lm sample --workdir $(WORKDIR)/sft --chat --prompt "sort 9071" --temperature 0

test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --max-worker-restart=0

# the unit tests alone (no end-to-end run, nothing marked slow): for iteration
check: $(VENV)/.installed
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow"

.PHONY: install demo test check
