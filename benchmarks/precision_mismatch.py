"""The engine/trainer mismatch of each trainer precision × engine dtype (issue 46): what a user sees in
`rollout/logprob_gap_max` and `mismatch/*` when the engine samples in bf16 or the trainer runs bf16
mixed precision, measured in the real pipeline.

One warm start (init-tiny → the demo's SFT), then `recipes/grpo_addition.yaml` for `--steps` steps per
combination, from the same seed: trainer fp32 or bf16 mixed precision (`train.bf16_cpu=true`: bf16 autocast
and bf16 parameter gathers, fp32 master weights) × engine float32 or bfloat16 (`engine.dtype`). Reports, over
the steps, the median of the per-step `mismatch/kl_k3` (the k3 estimate of KL(engine ‖ trainer) on the
sampled tokens), the median and largest `mismatch/ratio_max` (trainer/engine probability of a sampled token),
the largest `rollout/logprob_gap_max`, and the held-out accuracy after the steps.

    .venv/bin/python benchmarks/precision_mismatch.py --steps 10 --out bench-results/precision_mismatch.json

On a CPU without native bf16 (AVX512-BF16 or AMX), bf16 is emulated: the figures are the mismatch, not a speed.
With `--device cuda` the RL runs train and generate on the GPU (`runtime.device=cuda`; the warm start stays
on the CPU, as `gcore-rl sft` always does), and the bf16 trainer is `train.bf16=true`, CUDA's autocast:

    python3 benchmarks/precision_mismatch.py --device cuda --threads 4 --out OUT/precision_mismatch_cuda.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
from datetime import date
from pathlib import Path

from demo_seeds import GRPO_RECIPE, SFT_RECIPE, _jsonl, _run

COMBINATIONS = {
    ("fp32", "float32"): [],
    ("fp32", "bfloat16"): ["engine.dtype=bfloat16"],
    ("bf16", "float32"): ["train.bf16_cpu=true"],
    ("bf16", "bfloat16"): ["train.bf16_cpu=true", "engine.dtype=bfloat16"],
}
"""(trainer precision, engine dtype) → the overrides that select it."""


def overrides_on(device: str, overrides: list[str]) -> list[str]:
    """A combination's overrides on `device`: on CUDA the trainer's precision is `train.bf16` (default true)."""
    if device == "cpu":
        return overrides
    bf16 = "train.bf16_cpu=true" in overrides
    return ["runtime.device=cuda", f"train.bf16={str(bf16).lower()}",
            *(o for o in overrides if o != "train.bf16_cpu=true")]


def measure(work: Path, steps: int, seed: int, threads: int, device: str = "cpu") -> list[dict]:
    """The warm start in `work`, then one RL run per combination on `device`; one row of figures per
    combination."""
    _run(["init-tiny", "base", f"seed={seed}"], work)
    _run(["sft", str(SFT_RECIPE), "model.path=base", "output_dir=sft", f"seed={seed}", f"threads={threads}",
          "progress=false"], work)
    rows = []
    for (trainer, engine), overrides in COMBINATIONS.items():
        out = f"rl-{trainer}-{engine}"
        seconds = _run(["train", str(GRPO_RECIPE), "model.path=sft", f"run.output_dir={out}", f"run.seed={seed}",
                        f"run.steps={steps}", f"run.eval_every={steps}", "run.stop_at_eval_accuracy=0",
                        f"runtime.threads_per_process={threads}", "run.progress=false", *overrides_on(device, overrides)], work)
        metrics = _jsonl(work / out / "metrics.jsonl")
        rows.append({
            "trainer": trainer, "engine": engine, "steps": len(metrics), "seconds": round(seconds, 1),
            "kl_k3_median": statistics.median(m["mismatch/kl_k3"] for m in metrics),
            "ratio_max_median": statistics.median(m["mismatch/ratio_max"] for m in metrics),
            "ratio_max_max": max(m["mismatch/ratio_max"] for m in metrics),
            "logprob_gap_max": max(m["rollout/logprob_gap_max"] for m in metrics),
            "eval_after": metrics[-1].get("eval/accuracy"),
        })
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| trainer | engine | steps | mismatch/kl_k3 (median) | mismatch/ratio_max (median, max) | "
             "rollout/logprob_gap_max (max) | held-out acc. after | wall |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['trainer']} | {r['engine']} | {r['steps']} | {r['kl_k3_median']:.2e} | "
                     f"{r['ratio_max_median']:.4f}, {r['ratio_max_max']:.4f} | {r['logprob_gap_max']:.2e} | "
                     f"{r['eval_after']:.3f} | {r['seconds']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="precision-"))
    rows = measure(work, args.steps, args.seed, args.threads, args.device)
    flags = " ".join(f for f in ("avx512_bf16", "amx_bf16") if f in Path("/proc/cpuinfo").read_text()) or "no native bf16"
    if args.device == "cuda":
        import torch

        flags += f"; RL on {torch.cuda.get_device_name()}, torch {torch.__version__}"
    print(f"\n{date.today()}, {platform.machine()} {os.cpu_count()} cores ({flags}), seed {args.seed}, "
          f"{args.threads} thread(s) per process\n")
    print(table(rows))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
