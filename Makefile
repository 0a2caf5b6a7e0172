# tuneproof — the two commands a newcomer needs:
#   make demo   set everything up, start the embedded cluster, run the whole pipeline
#   make test   set everything up and run the test suite
#   make bench  tuneproof measured against the bare stack (bench/run.py; about 30 min on 2 idle cores)
VENV ?= .venv
PY := $(VENV)/bin/python
TP := $(VENV)/bin/tuneproof
PYTHON ?= python3

.PHONY: setup browser shellcheck demo test test-fast lint schema faults bench up down clean

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

# Both test targets list the fifteen slowest setups, calls and teardowns (over 1 s): the suite's time is a
# budget (make test ≤ 20 min, make test-fast ≤ 3 min on 2 cores), and this says where it goes.
DURATIONS := --durations=15 --durations-min=1.0

# The unit tests run in a second pytest process beside the integration tests (tests/run_tiers.sh says why).
test: setup browser shellcheck lint
	tests/run_tiers.sh $(PY) $(DURATIONS)

# Lint, format and types before any test: the same checks a reviewer would make, in seconds.
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The run record's JSON Schema, with each stage's summary model, from the stage table: run it when a model changes.
schema: setup
	$(PY) -m tuneproof.control.stages > schemas/run-record.schema.json

# The browser test drives Debian's Chromium (Playwright's own browser download cannot work offline).
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
	  else echo "chromium is not installed and cannot be installed here: the browser test will be skipped"; fi; }

# tests/test_eks_up.py runs shellcheck over deployments/eks-up.sh (Debian's package, as for the browser).
shellcheck:
	@command -v shellcheck >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq shellcheck >/dev/null; \
	  else echo "shellcheck is not installed and cannot be installed here: its test will be skipped"; fi; }

test-fast: setup shellcheck lint
	$(PY) -m pytest -q $(DURATIONS) -m "not integration and not browser"

# Inject each fault of issue 11 into a real small run (its own Ray head and Prefect server) and print the
# table; also bench/out/faults.json. About 19 minutes on 2 cores; not part of `make test`.
faults: setup
	$(PY) -m faults

# The full run caps the largest scaling sizes (1M rows, 10,000 eval examples take too long on 2 shared
# cores); `make bench BENCH_ARGS=` runs them all, `BENCH_ARGS="--quick"` a smoke run. Writes bench/out/.
BENCH_ARGS ?= --max-rows 100000 --max-eval 1000
bench: setup
	$(PY) -m bench.run $(BENCH_ARGS)

up: setup
	$(TP) local up

down:
	$(TP) local down

clean: down
	rm -rf .tuneproof
