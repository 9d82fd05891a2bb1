#!/usr/bin/env bash
# The benchmark environment `.venv-bench`: this package plus TRL, for benchmarks/grpo_vs_trl.py.
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

if [[ ! -f "$STAMP" || "$ROOT/pyproject.toml" -nt "$STAMP" || "${BASH_SOURCE[0]}" -nt "$STAMP" ]]; then
    test -d "$VENV" || "$PY" -m venv "$VENV"
    "$BIN/pip" install --quiet torch==2.13.0
    "$BIN/pip" install --quiet -e "$ROOT"
    "$BIN/pip" install --quiet "trl==$TRL_VERSION" "accelerate==$ACCELERATE_VERSION"
    echo "trl==$TRL_VERSION accelerate==$ACCELERATE_VERSION" > "$STAMP"
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

print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"trl {trl.__version__}  accelerate {accelerate.__version__}  datasets {datasets.__version__}  "
      f"tokenizers {tokenizers.__version__}")
EOF
