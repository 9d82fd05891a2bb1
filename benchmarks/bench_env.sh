#!/usr/bin/env bash
# The benchmark environment `.venv-bench`: this package plus TRL, for benchmarks/grpo_vs_trl.py, and verl's
# loss/advantage code for the parity fixtures (tests/algos/fixtures/make_reference_fixtures.py).
#
# TRL and accelerate are NOT dependencies of gcore-rl (pyproject.toml does not list them); they live
# only in this separate virtualenv. The install order is the project's (see the Makefile): the
# local CPU wheel `torch==2.13.0` first (any other torch spec would pull CUDA wheels), then this
# package in editable mode, then the pinned TRL and accelerate.
#
# Idempotent: a stamp file records what was installed; the install reruns only when the stamp is
# missing or older than pyproject.toml or this script. Run from anywhere:
#
#     bash benchmarks/bench_env.sh            # creates/updates .venv-bench, prints the versions
#     PY=python3.11 bash benchmarks/bench_env.sh
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-python3}"
VENV="$ROOT/.venv-bench"
BIN="$VENV/bin"
STAMP="$VENV/.installed"

# trl 1.16.0 requires transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0 and Python>=3.11
# (its wheel METADATA), so it accepts the project's transformers 5.23 / datasets 5.2.
TRL_VERSION="1.16.0"
ACCELERATE_VERSION="1.15.0"
# verl's `core_algos` is the second reference of tests/algos/fixtures/make_reference_fixtures.py. Its full
# dependency set pulls Ray and CUDA packages, so it installs without dependencies plus exactly what
# `verl.trainer.ppo.core_algos` imports.
VERL_PACKAGES=("verl==0.9.1" "tensordict==0.15.3" "pyvers==0.2.3" "cloudpickle==3.1.3" "omegaconf==2.4.0"
               "codetiming==1.4.0" "orjson==3.13.0")

if [[ ! -f "$STAMP" || "$ROOT/pyproject.toml" -nt "$STAMP" || "${BASH_SOURCE[0]}" -nt "$STAMP" ]]; then
    test -d "$VENV" || "$PY" -m venv "$VENV"
    "$BIN/pip" install --quiet torch==2.13.0
    "$BIN/pip" install --quiet -e "$ROOT"
    "$BIN/pip" install --quiet "trl==$TRL_VERSION" "accelerate==$ACCELERATE_VERSION"
    "$BIN/pip" install --quiet --no-deps "${VERL_PACKAGES[@]}"
    echo "trl==$TRL_VERSION accelerate==$ACCELERATE_VERSION ${VERL_PACKAGES[0]}" > "$STAMP"
else
    echo "$VENV is up to date ($(cat "$STAMP")); delete $STAMP to reinstall"
fi

"$BIN/python" - <<'EOF'
import sys

import accelerate
import datasets
import tokenizers
import torch
import transformers
import trl
import verl.trainer.ppo.core_algos  # noqa: F401  (importable without verl's full dependency set)

print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"trl {trl.__version__}  accelerate {accelerate.__version__}  datasets {datasets.__version__}  "
      f"tokenizers {tokenizers.__version__}")
EOF
