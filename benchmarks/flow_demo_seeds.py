"""Does `make demo-diffusion` learn on any seed and thread count? Runs its three commands per (seed, threads).

For each setting: `init-tiny-diffusion` (model seed), the flow-matching warm start (recipes/flow_sft_shapes.yaml,
seed), then Flow-GRPO (recipes/flow_grpo_shapes.yaml, run.seed); records the mean reward of the first and the
last 10 steps (half the steps each if the run stopped before 20), the held-out reward before and after, the steps to the recipe's stop criterion, and the wall time.
Usage: python benchmarks/flow_demo_seeds.py --seeds 0 1 2 --threads 1 2 --out bench-results/flow_demo_seeds.json
`--lora`: from each warm start, Flow-GRPO twice, training every parameter of the transformer and training LoRA
adapters (`LORA`), side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LORA = ("model.lora.enabled=true", "model.lora.rank=8", "model.lora.alpha=16", "train.lr=0.001")
"""`--lora`: rank-8 adapters on every linear layer of the transformer, at a learning rate above the recipe's
(adapters start at zero and move the weights through a low-rank product)."""


def _cli(*args: str, cwd: Path, threads: int) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return proc.stdout


def run_demo(workdir: Path, seed: int, threads: int, arms: dict[str, tuple[str, ...]]) -> list[dict]:
    """The demo's warm start for `seed`, then its Flow-GRPO run once per arm (name → extra overrides)."""
    start = time.perf_counter()
    _cli("init-tiny-diffusion", "base", f"seed={seed}", cwd=workdir, threads=threads)
    _cli("sft", str(REPO / "recipes/flow_sft_shapes.yaml"), "model_path=base", "output_dir=sft", f"seed={seed}",
         cwd=workdir, threads=threads)
    results = []
    for arm, overrides in arms.items():
        _cli("train", str(REPO / "recipes/flow_grpo_shapes.yaml"), "model.path=sft", f"run.output_dir=grpo-{arm}",
             f"run.seed={seed}", "run.progress=false", *overrides, cwd=workdir, threads=threads)
        summary = json.loads((workdir / f"grpo-{arm}/summary.json").read_text())  # the held-out reward before step 1 too
        results.append({"arm": arm, "seed": seed, "threads": threads, "steps": summary["steps"],
                        "first_rewards": summary["first_rewards"], "last_rewards": summary["last_rewards"],
                        "eval_before": summary["eval_reward_before"], "eval_after": summary["eval_reward_after"],
                        "wall_s": time.perf_counter() - start})
        start = time.perf_counter()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1])
    parser.add_argument("--out", default="bench-results/flow_demo_seeds.json")
    parser.add_argument("--lora", action="store_true", help="Flow-GRPO twice per warm start: every parameter, and LORA.")
    args = parser.parse_args()
    arms = {"full": (), "lora": LORA} if args.lora else {"full": ()}
    results = []
    for threads in args.threads:
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                runs = run_demo(Path(tmp), seed, threads, arms)
            results += runs
            for r in runs:
                print(f"seed {seed} threads {threads} {r['arm']}: {r['steps']} steps, reward {r['first_rewards']:.3f} → "
                      f"{r['last_rewards']:.3f} (+{r['last_rewards'] - r['first_rewards']:.3f}), held-out "
                      f"{r['eval_before']:.3f} → {r['eval_after']:.3f}, {r['wall_s']:.0f} s", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
