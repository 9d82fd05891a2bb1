#!/usr/bin/env bash
# The Python packages that benchmarks/gpu_check.sh needs and the lent GPU machines' image lacks or holds at
# another version, as wheels in .whl/ (ignored by git) for the device call to carry: nothing can be fetched
# there (/work/.library/device/KINDS.md lists the image's packages: torch 2.11 with CUDA, accelerate, peft,
# transformers 5.17, no TRL, datasets or diffusers). gpu_check.sh installs whatever .whl/ holds into
# /tmp/site before its parts run. About 32 MB; the call's whole tree must stay under 64 MiB.
#
#     bash benchmarks/gpu_wheels.sh                      # here, with network: fills .whl/
#     # then, through the device tool: carry [".whl"],
#     #   command "bash benchmarks/gpu_check.sh $OUT tests generation"
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-$ROOT/.venv/bin/python}"
# the project's tested versions (pyproject.toml; TRL as benchmarks/bench_env.sh pins it) and what they need
# beyond the image: datasets' dill and multiprocess, diffusers' importlib_metadata, plotly for the report
WHEELS=(transformers==5.24.0 trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 diffusers==0.42.1
        importlib_metadata==9.1.0 plotly==7.1.0 pebble==5.2.3)
rm -rf "$ROOT/.whl"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$ROOT/.whl" "${WHEELS[@]}"
du -sh "$ROOT/.whl"
