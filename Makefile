# tuneproof — the two commands a newcomer needs:
#   make demo   set everything up, start the embedded cluster, run the whole pipeline
#   make test   set everything up and run the test suite
VENV ?= .venv
PY := $(VENV)/bin/python
TP := $(VENV)/bin/tuneproof
PYTHON ?= python3

.PHONY: setup demo test test-fast up down clean

setup: $(VENV)/.installed

# Exact versions from constraints.txt: the run record names what ran, so installs must be reproducible.
$(VENV)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	touch $@

demo: setup
	$(TP) local up
	$(TP) run

test: setup
	$(PY) -m pytest -q

test-fast: setup
	$(PY) -m pytest -q -m "not integration and not browser"

up: setup
	$(TP) local up

down:
	$(TP) local down

clean: down
	rm -rf .tuneproof
