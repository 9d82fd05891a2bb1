# One install path for README, Makefile and CI: a .venv with torch==2.13.0 first, then the package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

## The default job: tiny model → supervised warm start → GRPO on 2-digit addition (CPU, a few minutes).
demo: $(STAMP)
	rm -rf runs/tiny-base runs/tiny-sft runs/grpo-addition
	$(BIN)/gcore-rl init-tiny runs/tiny-base
	$(BIN)/gcore-rl sft recipes/sft_addition.yaml
	$(BIN)/gcore-rl train recipes/grpo_addition.yaml

## The test suite (fast and integration tiers; < 10 minutes on 2 cores).
test: $(STAMP)
	$(BIN)/python -m pytest -q

## Longer runs marked `slow`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf runs .pytest_cache
