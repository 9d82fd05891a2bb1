"""What bounded staleness k (`placement.max_staleness`) buys under `disaggregated` when generation has a long tail.

The same small job runs with k = 1 (one-step-off), 2 and 3: the Ray runtime, one controller with one trainer
and one rollout device, GRPO on the synthetic addition task of recipes/grpo_addition.yaml (its sampling,
reward and algorithm; 16 prompts × 8 samples per step, no dynamic sampling), and a heavy-tailed rollout
time injected on the rollout device (`engine.added_seconds_tail`: each generate call also waits
`--tail` seconds times a Pareto(1.5) draw seeded by the call's seed, so every k sees the same delays in
the same steps). Reported per k: the median `time/step` over steps 3..N-K (K the largest k run: in the
last k steps the queue is not refilled, so those steps make no rollout and would flatter a larger k),
the step rate against k = 1
(median step time of k = 1 / that of k), the largest and mean staleness of the trained samples, and the
greedy accuracy on held-out prompts and the mean reward of the last steps at the end (learning must not
suffer). The runs are single runs on one seed: read the accuracy against the spread one seed shows.

The controller's rollouts block it (controller/loop.py), so each update overlaps only the rollouts made
during it, and k > 1 is expected to leave the step time where k = 1 has it (a long rollout stalls the
trainer whatever k is); this benchmark is the measurement behind that claim.

Run from the repository root (the model defaults to a fresh `gcore-rl init-tiny`; `--model runs/tiny-sft`,
the warm start of the recipe, shows learning in a few steps):

    .venv/bin/python benchmarks/staleness.py --model runs/tiny-sft --out bench-results/staleness.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_addition.yaml"
JOB = ["run.prompts_per_step=16", "run.stop_at_eval_accuracy=0", "run.eval_every=0", "data.eval_prompts=128",
       "dynamic_sampling.enabled=false", "run.save_final=false", "run.progress=false", "train.micro_batch_size=64",
       "runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2",
       "runtime.threads_per_process=1", "placement.strategy=disaggregated"]


def cli(*args: str, cwd: Path) -> float:
    """Run `gcore-rl ARGS` and return its wall time (raises when it fails)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"gcore-rl {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def run_one(model: Path, out: Path, k: int, steps: int, tail: float, seed: int, window: range) -> dict:
    """Train with staleness bound `k`; the figures of one row of the table."""
    wall = cli("train", str(RECIPE), f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}",
               f"run.seed={seed}", f"placement.max_staleness={k}", f"engine.added_seconds_tail={tail}", *JOB, cwd=REPO)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [line["time/step"] for line in lines if line["step"] in window]  # each makes one rollout under every k
    last = lines[-3:]
    return {"k": k, "steps": len(lines), "timed_steps": [window.start, window.stop - 1], "wall_s": wall, "median_step_s": statistics.median(timed),
            "step_s": [line["time/step"] for line in lines],
            "staleness_max": max(line["rollout/staleness_max"] for line in lines),
            "staleness_mean": statistics.fmean(line["rollout/staleness_mean"] for line in lines),
            "eval_accuracy_end": lines[-1].get("eval/accuracy"),
            "reward_last3": statistics.fmean(line["reward/mean"] for line in last)}


def table(rows: list[dict]) -> str:
    """The Markdown table of the rows, with each k's step rate against k = 1."""
    base = next(row["median_step_s"] for row in rows if row["k"] == 1)
    out = [f"| k | median time/step, steps {rows[0]['timed_steps'][0]}..{rows[0]['timed_steps'][1]} (s) | step rate vs k=1 | staleness max / mean | "
           "eval accuracy at end | reward, last 3 steps | wall (s) |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        accuracy = "n/a" if row["eval_accuracy_end"] is None else f"{row['eval_accuracy_end']:.3f}"
        out.append(f"| {row['k']} | {row['median_step_s']:.2f} | {base / row['median_step_s']:.2f}x | "
                   f"{row['staleness_max']:.0f} / {row['staleness_mean']:.2f} | {accuracy} | "
                   f"{row['reward_last3']:.3f} | {row['wall_s']:.0f} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="policy folder (default: a fresh gcore-rl init-tiny)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="staleness bounds to run (1 is needed)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tail", type=float, default=0.3, help="engine.added_seconds_tail (seconds)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args()
    if 1 not in args.ks:
        parser.error("--ks must include 1, the baseline")
    if args.steps - max(args.ks) < 5:
        parser.error("--steps must exceed the largest k by at least 5 (steps 3..N-K are timed)")
    with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
        work = Path(tmp)
        model = args.model.resolve() if args.model else work / "tiny"
        if args.model is None:
            cli("init-tiny", str(model), cwd=REPO)
        window = range(3, args.steps - max(args.ks) + 1)
        rows = [run_one(model, work / f"k{k}", k, args.steps, args.tail, args.seed, window) for k in sorted(args.ks)]
    print(table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(args.model or "init-tiny"), "steps": args.steps,
                                        "tail_s": args.tail, "seed": args.seed, "job": JOB, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
