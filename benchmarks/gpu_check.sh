#!/usr/bin/env bash
# What the project's CUDA paths do on one GPU (BENCHMARKS.md "On a GPU"). Parts (all by default):
#   tests       the tests that need CUDA (the engine's sleep frees GPU memory; a Flow-GRPO job on CUDA);
#   demo        `make demo` with the GRPO run on CUDA (runtime.device=cuda; the warm start runs on the CPU, as it
#               always does): eval accuracy, steps, time per step, engine/trainer log-prob gap (metrics.jsonl);
#   single      a few steps of a single-pass update on CUDA (train.mini_batches=1: the old log-probs come from
#               the update's own forward, a path the demo's two mini-batches do not take);
#   diffusion   `make demo-diffusion` with the Flow-GRPO run on CUDA;
#   checkpoint  the checkpoint benchmark's trainer part on CUDA (a Qwen2-0.5B-shaped trainer; staging is a
#               device-to-host copy into pinned buffers);
#   long_tail   benchmarks/long_tail.py on CUDA: padded / token-budget / packed passes of a long-tailed batch
#               (completions 8..2048 tokens) on a 110M-parameter llama, fp32 (log-prob and weight equality)
#               and bf16 autocast with activation checkpointing;
#   flow_engine benchmarks/flow_engine.py part 1 on CUDA: our FlowSampler against diffusers' pipeline;
#   memory      benchmarks/memory.py on CUDA (issue 46): each phase's peak of allocated device memory for full
#               fine-tuning (bf16 autocast and fp32), LoRA and train.offload, Qwen2-0.5B and 1.5B shapes, colocated;
#   logprob_memory  benchmarks/logprob_memory.py on CUDA: the chunked LM head against full logits, Qwen2-0.5B's
#               24 layers, 8 x 1,024 tokens, fp32 and bf16 autocast;
#   precision   benchmarks/precision_mismatch.py on CUDA: engine/trainer mismatch per trainer precision x engine dtype;
#   generation  issue 49, at most 8 minutes (each command under its own `timeout`, started only where it would end
#               inside them, in the order the issue's targets need them; the wall of each is printed; run it in a
#               device call of its own, after one with `tests`): the GRPO step against TRL's at hidden 256 x 4 and 1024 x 8
#               layers, fp32 then bf16 (benchmarks/grpo_vs_trl.py), the image engine against diffusers, with and
#               without CUDA graphs (benchmarks/flow_engine.py part 1), the decode step of a Qwen2-0.5B shape at batch 64 against the
#               bandwidth roofline, with and without CUDA graphs (benchmarks/roofline.py), the engine's arms (graphs;
#               eager; eager reading every round, the engine before issue 49) against transformers' generate at
#               batches 8/64/256 (benchmarks/engine_vs_generate.py); then benchmarks/gpu_generation_summary.py
#               prints the tables and verdicts.
# Not in the default set: long_tail, flow_engine, memory, logprob_memory, precision, generation.
# Usage: bash benchmarks/gpu_check.sh OUT_DIR [PART ...]   (from the repository root)
# The GPU image lacks TRL, datasets and diffusers and has another transformers: `bash benchmarks/gpu_wheels.sh`
# here fills .whl/, the device call carries it (carry [".whl"]), and this script installs it into /tmp/site.
set -euo pipefail
out=${1:?usage: gpu_check.sh OUT_DIR [tests demo single diffusion checkpoint long_tail flow_engine memory logprob_memory precision generation]}
shift
parts=${*:-tests demo single diffusion checkpoint}
mkdir -p "$out"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # gcore_rl for every child process (TRL's side too)
cli() { python3 -m gcore_rl.cli "$@"; }
wants() { [[ " $parts " == *" $1 "* ]]; }
summary() {  # metrics.jsonl, the times at which the warm start began, the RL run began and ended, the eval key
  python3 - "$@" <<'EOF'
import json, statistics, sys
path, key = sys.argv[1], sys.argv[5]
warm_s, rl_s = float(sys.argv[3]) - float(sys.argv[2]), float(sys.argv[4]) - float(sys.argv[3])
rows = [json.loads(line) for line in open(path)]
steps = [r for r in rows if "time/step" in r or "time/rollout_s" in r]
evals = [r[key] for r in rows if key in r]
gaps = [r[k] for r in steps for k in ("rollout/logprob_gap_max", "train/logprob_gap_max") if k in r]
times = [r.get("time/step", r.get("time/rollout_s", 0) + r.get("time/update_s", 0) + r.get("time/sync_s", 0))
         for r in steps]
print(json.dumps({"warm_start_wall_s": round(warm_s, 1), "rl_wall_s": round(rl_s, 1), "steps": len(steps),
                  "median_step_s": statistics.median(times) if times else None,
                  f"{key}_first_last": [evals[0], evals[-1]] if evals else None,
                  "logprob_gap_max": max(gaps) if gaps else None}, indent=1))
EOF
}

python3 - <<'EOF'
import torch, transformers
print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
      f"{torch.cuda.get_device_name()} ({torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB)")
EOF

if wants tests; then
  echo "== tests that need CUDA"
  python3 -m pytest -q -p no:cacheprovider -p no:randomly tests/rollout/test_engine.py tests/diffusion/test_flow_cuda.py \
    tests/telemetry/test_metrics.py -k "cuda" -rs || echo "TESTS FAILED"
fi

if wants demo; then
  echo "== the demo, GRPO on CUDA"
  rm -rf runs/tiny-base runs/tiny-sft runs/grpo-addition
  cli init-tiny runs/tiny-base
  start=$(date +%s.%N)
  cli sft recipes/sft_addition.yaml progress=false
  mid=$(date +%s.%N)
  cli train recipes/grpo_addition.yaml runtime.device=cuda run.progress=false
  end=$(date +%s.%N)
  cp runs/grpo-addition/metrics.jsonl "$out/demo_cuda_metrics.jsonl"
  summary "$out/demo_cuda_metrics.jsonl" "$start" "$mid" "$end" eval/accuracy
fi

if wants single; then
  echo "== a single-pass update on CUDA"
  rm -rf runs/single-base runs/single-pass
  cli init-tiny runs/single-base
  cli train recipes/grpo_addition.yaml model.path=runs/single-base runtime.device=cuda train.mini_batches=1 \
    run.steps=3 run.stop_at_eval_accuracy=0 run.progress=false run.output_dir=runs/single-pass
  summary runs/single-pass/metrics.jsonl 0 0 0 eval/accuracy
fi

if wants diffusion; then
  echo "== the diffusion demo, Flow-GRPO on CUDA"
  rm -rf runs/tiny-flow runs/tiny-flow-sft runs/flow-grpo-shapes
  cli init-tiny-diffusion runs/tiny-flow
  start=$(date +%s.%N)
  cli sft recipes/flow_sft_shapes.yaml
  mid=$(date +%s.%N)
  cli train recipes/flow_grpo_shapes.yaml runtime.device=cuda run.progress=false
  end=$(date +%s.%N)
  cp runs/flow-grpo-shapes/metrics.jsonl "$out/diffusion_cuda_metrics.jsonl"
  summary "$out/diffusion_cuda_metrics.jsonl" "$start" "$mid" "$end" eval/reward
fi

if wants long_tail; then
  echo "== long-tailed batch on CUDA: fp32, then bf16 with activation checkpointing"
  model=(arch=llama hidden_size=1024 num_layers=8 num_heads=16 num_kv_heads=4 intermediate_size=2816
         max_positions=2304)
  python3 benchmarks/long_tail.py --device cuda --repeats 2 --max-len 2048 --budget 16384 --no-torch-memory \
    --model "${model[@]}" --out "$out/long_tail_cuda.json" || echo "LONG_TAIL FP32 FAILED"
  python3 benchmarks/long_tail.py --device cuda --bf16 --repeats 2 --max-len 2048 --budget 16384 \
    --no-torch-memory --activation-checkpointing --model "${model[@]}" --out "$out/long_tail_cuda_bf16.json" \
    || echo "LONG_TAIL BF16 FAILED"
fi

if wants flow_engine; then
  echo "== the diffusion engine against diffusers' pipeline on CUDA (part 1)"
  python3 benchmarks/flow_engine.py --device cuda --threads 8 --skip-step --repeats 3 --large-batches 8 32 \
    --out "$out/flow_engine_cuda.json" || echo "FLOW_ENGINE FAILED"
fi

if wants memory; then
  echo "== memory per role and phase on CUDA"
  python3 benchmarks/memory.py --device cuda --policy 0.5b --steps 3 --variants full full-fp32 lora \
    offload-optimizer offload-all lora-offload-all --threads 4 --work-dir /tmp/memory-0.5b \
    --out "$out/memory_cuda_0.5b.json" || echo "MEMORY 0.5B FAILED"
  python3 benchmarks/memory.py --device cuda --policy 1.5b --steps 3 --variants full lora lora-offload-all \
    --threads 4 --work-dir /tmp/memory-1.5b --out "$out/memory_cuda_1.5b.json" || echo "MEMORY 1.5B FAILED"
fi

if wants logprob_memory; then
  echo "== the chunked LM head's peak on CUDA"
  python3 benchmarks/logprob_memory.py --device cuda --layers 24 --repeats 2 --threads 4 \
    --out "$out/logprob_memory_cuda.json" || echo "LOGPROB_MEMORY FAILED"
  python3 benchmarks/logprob_memory.py --device cuda --bf16 --layers 24 --repeats 1 --threads 4 \
    --out "$out/logprob_memory_cuda_bf16.json" || echo "LOGPROB_MEMORY BF16 FAILED"
fi

if wants precision; then
  echo "== engine/trainer mismatch per precision on CUDA"
  python3 benchmarks/precision_mismatch.py --device cuda --threads 4 --steps 10 --work-dir /tmp/precision \
    --out "$out/precision_mismatch_cuda.json" || echo "PRECISION FAILED"
fi

if wants generation; then
  echo "== issue 49: generation on CUDA (at most 8 minutes)"
  gen_start=$SECONDS
  timed() {  # LIMIT_S NAME COMMAND...: the command under `timeout`, skipped where it could end past the 8 minutes
    local limit=$1 name=$2 t0=$SECONDS; shift 2
    if (( SECONDS - gen_start + limit > 480 )); then echo "-- $name: skipped (the part's 8 minutes)"; return; fi
    timeout "$limit" "$@" || echo "-- $name: FAILED or cut at ${limit} s (what it measured before is in its JSON)"
    echo "-- $name: $((SECONDS - t0)) s"
  }
  grpo() {  # PRECISION HIDDEN LAYERS PAIRS LIMIT: our GRPO step against TRL's (the JSON is rewritten after each pair)
    timed "$5" "grpo_vs_trl $1 h$2x$3" python3 benchmarks/grpo_vs_trl.py --device cuda --python python3 --quiet-wait 1 \
      --timeout 80 --repeats "$4" --hidden-size "$2" --num-layers "$3" $([[ $1 == bf16 ]] && echo --bf16) \
      --out "$out/grpo_vs_trl_h$2x$3_$1.json"
  }
  grpo fp32 256 4 2 90
  grpo fp32 1024 8 2 90
  timed 80 flow_engine python3 benchmarks/flow_engine.py --device cuda --threads 8 --skip-step --repeats 3 \
    --large-batches 8 32 --eager-arm --out "$out/flow_engine_graphs_cuda.json"
  timed 40 roofline python3 benchmarks/roofline.py --shape qwen2-0.5b --batches 64 --engine-arms default,eager \
    --skip-train --repeats 2 --out "$out/roofline_cuda.json"
  grpo bf16 256 4 1 60
  grpo bf16 1024 8 1 60
  timed 60 engine_vs_generate python3 benchmarks/engine_vs_generate.py --device cuda --threads 4 --repeats 2 \
    --engine-arms default,eager,eager-sync --hidden-size 1024 --num-layers 8 --intermediate-size 2816 \
    --batches 8:32,64:256,256:512 --out "$out/engine_vs_generate_cuda.json"
  python3 benchmarks/gpu_generation_summary.py "$out" | tee "$out/generation_summary.md" || echo "SUMMARY FAILED"
fi

if wants checkpoint; then
  echo "== checkpoint cost, trainer on CUDA"
  python3 benchmarks/checkpoint_cost.py --skip-job --device cuda --trainer-repeats 2 --out "$out/checkpoint_cost_cuda.json"
fi
