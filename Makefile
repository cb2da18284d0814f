# Two commands on a fresh machine: `make train` and `make test` (each sets itself up).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.mtx-installed
CONFIG ?= configs/multi30k_de_en.yaml
RUN_DIR ?= runs/$(basename $(notdir $(CONFIG)))
ARGS ?=
# `make bench` runs both benchmarks, whose options differ: each its own (`make bench-train ARGS=...` alone takes ARGS)
TRAIN_ARGS ?=
DECODE_ARGS ?=

.PHONY: install train test lint format bench bench-train bench-decode bench-ct2 bench-onmt clean

# Why an existing venv cannot be used (empty where it can, or where there is none): its Python gone
# (uninstalled, upgraded) or older than 3.10, made without pip, or made at another path (a moved or
# renamed clone: its scripts' #! lines name the old one). Such a venv is made again, saying why.
VENV_PROBLEM := $(shell [ -d $(VENV) ] || exit 0; \
	version=$$($(BIN)/python -c 'import sys; print("%d.%d" % sys.version_info[:2]); sys.exit(sys.version_info < (3, 10))' 2>/dev/null); \
	status=$$?; \
	if [ $$status = 1 ] && [ -n "$$version" ]; then echo "has Python $$version, mtx needs 3.10+"; \
	elif [ $$status != 0 ]; then echo "has a python that does not run (the Python it was made from is gone?)"; \
	elif [ ! -x $(BIN)/pip ]; then echo "has no pip"; \
	elif ! grep -qF '$(abspath $(BIN))/python' $(BIN)/pip; then echo "was made at another path (a moved clone)"; fi)
ifneq ($(VENV_PROBLEM),)
.PHONY: $(STAMP)
endif

# torch is pinned first: the pin takes the CPU wheel on this machine (a regular build elsewhere);
# pyproject.toml keeps the honest range torch>=2.4, which the pinned install already satisfies.
$(STAMP): pyproject.toml
	@if [ -n "$(VENV_PROBLEM)" ] || [ ! -d $(VENV) ]; then \
		[ -z "$(VENV_PROBLEM)" ] || echo "make: $(VENV) $(VENV_PROBLEM): making it again"; \
		$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
			echo "make: mtx needs Python 3.10+, $(PYTHON) is $$($(PYTHON) --version 2>&1): give a newer one as PYTHON=..."; exit 1; }; \
		echo "$(PYTHON) -m venv --clear $(VENV)"; $(PYTHON) -m venv --clear $(VENV); \
	fi
	@echo "make: installing torch 2.13.0 and mtx's dependencies into $(VENV) (minutes; a CUDA build of torch is GBs)"
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev,plot]'
	$(BIN)/pip install --quiet -e '.[export]' || echo 'note: no CTranslate2 wheel for this platform; mtx export and its tests are skipped'
	touch $(STAMP)

install: $(STAMP)

# a run that has saved a checkpoint is continued (an interrupted `make train` goes on where it stopped)
train: $(STAMP)
	@if [ -f "$(RUN_DIR)/checkpoints/last.pt" ]; then \
		echo "make train: $(RUN_DIR) holds a run: continuing it (--resume, with its own config.yaml)"; \
		$(BIN)/mtx train --run-dir "$(RUN_DIR)" --resume $(ARGS); \
	else \
		$(BIN)/mtx train --config "$(CONFIG)" --run-dir "$(RUN_DIR)" $(ARGS); \
	fi

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

lint: $(STAMP)
	$(BIN)/ruff check mtx tests scripts
	$(BIN)/ruff format --check mtx tests scripts

format: $(STAMP)
	$(BIN)/ruff check --fix mtx tests scripts
	$(BIN)/ruff format mtx tests scripts

bench: $(STAMP)
	$(BIN)/python scripts/bench_train.py $(TRAIN_ARGS)
	$(BIN)/python scripts/bench_decode.py $(DECODE_ARGS)

bench-train: $(STAMP)
	$(BIN)/python scripts/bench_train.py $(ARGS)

bench-decode: $(STAMP)
	$(BIN)/python scripts/bench_decode.py $(ARGS)

# mtx beside CTranslate2 on a trained run: make bench-ct2 ARGS="--run runs/multi30k_de_en"
bench-ct2: $(STAMP)
	$(BIN)/python scripts/bench_ctranslate2.py $(ARGS)

# mtx beside OpenNMT-py 3.5, which runs under its own Python (scripts/bench_onmt.py's docstring sets it up):
# make bench-onmt ARGS="--run runs/multi30k_de_en --onmt-python onmt-venv/bin/python"
bench-onmt: $(STAMP)
	$(BIN)/python scripts/bench_onmt.py $(ARGS)

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache
