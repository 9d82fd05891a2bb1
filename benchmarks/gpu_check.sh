#!/usr/bin/env bash
# What the project's CUDA paths do on one GPU, in one go (BENCHMARKS.md "On a GPU"):
#   1. the test that needs CUDA (the engine's sleep frees GPU memory);
#   2. `make demo` with the GRPO run on CUDA (runtime.device=cuda; the warm start runs on the CPU, as it
#      always does): eval accuracy, steps, time per step and the engine/trainer log-prob gap, from metrics.jsonl;
#   3. the checkpoint benchmark's trainer part on CUDA (a Qwen2-0.5B-shaped trainer; staging is a
#      device-to-host copy into pinned buffers).
# Usage: bash benchmarks/gpu_check.sh OUT_DIR   (from the repository root, with gcore_rl importable)
set -euo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
cli() { python3 -m gcore_rl.cli "$@"; }

python3 - <<'EOF'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)")
EOF

echo "== 1. tests that need CUDA"
python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/rollout/test_engine.py -k cuda -rs || echo "TESTS FAILED"

echo "== 2. the demo, GRPO on CUDA"
rm -rf runs/tiny-base runs/tiny-sft runs/grpo-addition
cli init-tiny runs/tiny-base
start=$(date +%s.%N)
cli sft recipes/sft_addition.yaml progress=false
mid=$(date +%s.%N)
cli train recipes/grpo_addition.yaml runtime.device=cuda run.progress=false
end=$(date +%s.%N)
cp runs/grpo-addition/metrics.jsonl "$out/demo_cuda_metrics.jsonl"
python3 - "$out/demo_cuda_metrics.jsonl" "$start" "$mid" "$end" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
steps = [r for r in rows if "time/step" in r]
evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
gaps = [r["rollout/logprob_gap_max"] for r in steps if "rollout/logprob_gap_max" in r]
sft_s, grpo_s = float(sys.argv[3]) - float(sys.argv[2]), float(sys.argv[4]) - float(sys.argv[3])
print(json.dumps({"sft_wall_s": round(sft_s, 1), "grpo_wall_s": round(grpo_s, 1), "steps": len(steps),
                  "median_step_s": statistics.median(r["time/step"] for r in steps),
                  "eval_accuracy_first_last": [evals[0], evals[-1]] if evals else None,
                  "logprob_gap_max": max(gaps) if gaps else None}, indent=1))
EOF

echo "== 3. checkpoint cost, trainer on CUDA"
python3 benchmarks/checkpoint_cost.py --skip-job --device cuda --trainer-repeats 2 --out "$out/checkpoint_cost_cuda.json"
