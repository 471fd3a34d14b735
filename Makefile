# Two commands for a newcomer:  make demo  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu

.PHONY: demo test test-slow lint format install clean soak

install: $(STAMP)

# torch is pinned to the CPU build that pyproject.toml names (an unpinned torch pulls a CUDA build)
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,examples]'
	$(BIN)/python -m ds_dynatrain.prebuild
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py --compare-static --out runs/demo

# lint and format check first (ruff, configured in pyproject.toml), then the suite
test: lint
	$(BIN)/python -m pytest

# the slow multi-process cases (marked slow, deselected by `make test`): a path a faster test also covers,
# at another ZeRO stage, signal or length (the main job under ZeRO-3, SIGINT to the launcher, ten 4→2→4 cycles)
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# the soak and fuzz suite (tests/soak/, deselected by `make test`): 100 resize cycles in one job,
# 100 SIGKILLs mid-flush, 10,000 corruptions put to four readers, 50 short resizing jobs; shorter
# with SOAK_CYCLES=, SOAK_KILLS=, SOAK_CORRUPTIONS=, SOAK_JOBS= (SOAK_SEED= for the random parts);
# each part prints its figures and writes them to runs/soak/<part>.json
soak: $(STAMP)
	$(BIN)/python -m pytest tests/soak -m soak -s

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs .pytest_cache .hypothesis
