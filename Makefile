# The two commands: `make run` (the full pipeline on the embedded default) and
# `make test` (the test suite). Both create or reuse .venv and install the project;
# running them again installs nothing new.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml constraints.txt | sha1sum | cut -c1-12)

.PHONY: run test bench install

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[dev]'
	rm -f $(VENV)/.installed-* && touch $@

run: $(STAMP)
	$(PY) -m flows.cli run $(ARGS)

test: $(STAMP)
	HF_HUB_OFFLINE=1 $(PY) -m pytest $(ARGS)  # no path given: pyproject testpaths (tests/)

bench: $(STAMP)
	$(PY) -m pip install -q -c constraints.txt -e '.[bench]'
	$(PY) bench/run_all.py $(ARGS)
