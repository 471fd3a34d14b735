# Two commands for a newcomer:  make demo  |  make test
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export DS_ACCELERATOR ?= cpu

.PHONY: demo demo-trainer test test-slow lint format install clean soak compat gpu-check gpu-wheels

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

# the Hugging Face Trainer demo: fine-tune on 2 processes with snapshots, resume on 3 from one,
# compare the losses with the run that went on (examples/demo_trainer.py)
demo-trainer: $(STAMP)
	$(BIN)/python examples/demo_trainer.py --out runs/demo-trainer

# lint and format check first (ruff, configured in pyproject.toml), then the suite
test: lint
	$(BIN)/python -m pytest

# the slow multi-process cases (marked slow, deselected by `make test`): the rest of each matrix whose
# first case `make test` runs (ZeRO stages, precisions, world sizes, signals, launchers), whole jobs
# that a faster test covers part of, and DeepSpeed's universal route as an oracle; `make test` and
# `make test-slow` together are the whole suite
test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

# the soak and fuzz suite (tests/soak/, deselected by `make test`): 100 resize cycles in one job,
# 100 SIGKILLs mid-flush, 10,000 corruptions put to four readers, 50 short resizing jobs; shorter
# with SOAK_CYCLES=, SOAK_KILLS=, SOAK_CORRUPTIONS=, SOAK_JOBS= (SOAK_SEED= for the random parts);
# each part prints its figures and writes them to runs/soak/<part>.json
soak: $(STAMP)
	$(BIN)/python -m pytest tests/soak -m soak -s

# the low end of pyproject.toml's deepspeed range, in a second venv: torch 2.13.0 (CPU) first, then
# the project with DeepSpeed $(DEEPSPEED_LOW); then a resize, snapshots and a load at another world size
COMPAT_VENV := .venv-compat
DEEPSPEED_LOW ?= 0.19.7
COMPAT_STAMP := $(COMPAT_VENV)/.installed-deepspeed-$(DEEPSPEED_LOW)
COMPAT_TESTS ?= tests/test_groups.py tests/test_resize_state.py::test_bf16_resizes_move_the_master_in_small_chunks \
	tests/test_launchers.py::test_torchrun_saves_on_two_processes_and_loads_on_one

compat: $(COMPAT_STAMP)
	$(COMPAT_VENV)/bin/python -c 'import deepspeed, torch; print("compat: deepspeed", deepspeed.__version__, "torch", torch.__version__)'
	$(COMPAT_VENV)/bin/python -m pytest -p no:cacheprovider $(COMPAT_TESTS)

$(COMPAT_STAMP): pyproject.toml
	rm -f $(COMPAT_VENV)/.installed-*
	$(PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_VENV)/bin/pip install --quiet --upgrade pip
	$(COMPAT_VENV)/bin/pip install --quiet torch==2.13.0
	$(COMPAT_VENV)/bin/pip install --quiet -e '.[test,examples]' deepspeed==$(DEEPSPEED_LOW)
	$(COMPAT_VENV)/bin/python -m ds_dynatrain.prebuild
	touch $@

# the GPU check (benchmarks/gpu_check.py, README "GPU check"): ZeRO-2 on CUDA tensors resized 2 -> 1 -> 2
# over gloo, a snapshot of device state, a one-rank NCCL engine that snapshots and reloads; one JSON
# line, at most 8 minutes. Without a GPU it prints one line saying why it skipped and exits 0. Nothing
# is downloaded: it runs under .venv's python when that torch sees a GPU, else under $(GPU_PYTHON) (a
# python with a CUDA build of torch), with what that python lacks installed first from the wheels in
# $(GPU_WHEELS) into $(GPU_SITE) (made by `make gpu-wheels` on a machine with the package index)
GPU_PYTHON ?= python3
GPU_PYTHON_VERSION ?= 3.12
GPU_WHEELS ?= .gpu-wheels
GPU_SITE := runs/gpu-site
HAS_CUDA := -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64

gpu-check:
	@py=$(GPU_PYTHON); \
	if [ -x $(BIN)/python ] && $(BIN)/python $(HAS_CUDA) 2>/dev/null; then py=$(BIN)/python; \
	elif [ -x $(BIN)/python ] && ! $(GPU_PYTHON) $(HAS_CUDA) 2>/dev/null; then py=$(BIN)/python; fi; \
	site=; \
	if [ "$$py" != "$(BIN)/python" ] && [ -d $(GPU_WHEELS) ]; then \
		rm -rf $(GPU_SITE); \
		$$py -m pip install --quiet --no-index --no-deps --no-compile --target $(GPU_SITE) $(GPU_WHEELS)/*.whl || exit 1; \
		site=$(CURDIR)/$(GPU_SITE); \
	fi; \
	PYTHONPATH=$$site timeout 520 $$py -m benchmarks.gpu_check

# the wheels gpu-check installs on a GPU machine without the package index (CPython $(GPU_PYTHON_VERSION),
# x86-64 Linux), at the versions .venv has: binary wheels as published, source-only packages built here
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(BIN)/pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON_VERSION) --implementation cp \
		$(GPU_PLATFORMS) -d $(GPU_WHEELS) $$($(BIN)/python -m benchmarks.gpu_check --pins binary)
	$(BIN)/pip wheel --quiet --no-deps --no-build-isolation -w $(GPU_WHEELS) $$($(BIN)/python -m benchmarks.gpu_check --pins source)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

clean:
	rm -rf runs .pytest_cache .hypothesis
