# Everything a fresh clone needs, from a machine with only Python 3.11 and pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip check
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/tidal local demo --minutes 3 --report runs/demo.json

test: $(STAMP)
	$(BIN)/python -m pytest

bench: $(STAMP)
	$(BIN)/python bench/pipeline.py
	$(BIN)/python bench/reshard.py
	$(BIN)/python bench/predictor.py
	$(BIN)/python bench/planner.py
	$(BIN)/python bench/decide.py
	$(BIN)/python bench/sim.py

clean:
	rm -rf $(VENV) runs
