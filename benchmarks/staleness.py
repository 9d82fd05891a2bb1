"""What bounded staleness k (`placement.max_staleness`) buys under `disaggregated` when generation has a long tail.

The same small job runs with k = 1 (one-step-off), 2 and 3: the Ray runtime, one controller with one trainer
and one rollout device, GRPO on the synthetic addition task of recipes/grpo_addition.yaml (its sampling,
reward and algorithm; 16 prompts × 8 samples per step, no dynamic sampling), and a heavy-tailed rollout
time injected on the rollout device (`engine.added_seconds_tail`: each generate call also waits
`--tail` seconds times a Pareto(1.5) draw seeded by the call's seed, so every k sees the same delays in
the same steps). Reported per k: the mean `time/step` over all N steps (the time to train N steps, whose
N rollouts and N updates are the same work under any k; a long tail shows in the mean, not in a median)
and the median, the step rate against k = 1 (mean of k = 1 / mean of k), the largest and mean staleness
of the trained samples, and the greedy accuracy on held-out prompts and the mean reward of the last steps
at the end (learning must not suffer). A window that leaves steps out is not fair: a larger k makes some
rollouts during earlier steps (k = 3 makes those of steps 2-4 during step 1), and a slow rollout stalls the trainer at a step that depends on k (seed 0 draws one 14-s rollout at
--tail 0.2: k = 1 pays it at step 37, k = 2 and 3 at step 38), so a window can keep it for one k and drop
it for another (an earlier version of this script timed steps 3..N-K and showed 1.5x from exactly that).
The runs are single runs on one seed: read the accuracy against the spread one seed shows.

With k = 1 the controller makes the next rollout during the update, so a rollout longer than the update
stalls the trainer by the difference. With k > 1 the rollouts come from a thread of the controller
(controller/producer.py) that runs up to k steps ahead, each rollout with the weights of update s-1-k, so a
slow rollout stalls the trainer only when the queue has run dry: the step rate should approach the slower
side's mean instead of the mean of the per-step maximum. This benchmark measures how much of that shows.

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
# lr 1e-4: the recipe's 5e-4 is tuned for 64 prompts a step with dynamic sampling; at 16 prompts without it the
# warm start collapsed within 16 steps even in colocate (held-out 0.336 -> 0.008; 1e-4: 0.336 -> 0.469)
JOB = ["run.prompts_per_step=16", "run.stop_at_eval_accuracy=0", "run.eval_every=0", "data.eval_prompts=128",
       "train.lr=0.0001", "train.warmup_steps=0",  # as measured (the recipe has had a warm-up since 2026-11-28)
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


def run_one(model: Path, out: Path, k: int, steps: int, tail: float, seed: int, window: range,
            update_s: float = 0.0) -> dict:
    """Train with staleness bound `k`; the figures of one row of the table."""
    wall = cli("train", str(RECIPE), f"model.path={model}", f"run.output_dir={out}", f"run.steps={steps}",
               f"run.seed={seed}", f"placement.max_staleness={k}", f"engine.added_seconds_tail={tail}",
               f"train.added_seconds_per_update={update_s}", *JOB, cwd=REPO)
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    timed = [line["time/step"] for line in lines if line["step"] in window]
    last = lines[-3:]
    return {"k": k, "steps": len(lines), "timed_steps": [window.start, window.stop - 1], "wall_s": wall,
            "median_step_s": statistics.median(timed), "mean_step_s": statistics.fmean(timed),
            "step_s": [line["time/step"] for line in lines], "reward_per_step": [line["reward/mean"] for line in lines],
            "staleness_max": max(line["rollout/staleness_max"] for line in lines),
            "staleness_mean": statistics.fmean(line["rollout/staleness_mean"] for line in lines),
            "eval_accuracy_end": lines[-1].get("eval/accuracy"),
            "reward_last3": statistics.fmean(line["reward/mean"] for line in last)}


def table(rows: list[dict]) -> str:
    """The Markdown table of the rows, with each k's step rate against k = 1."""
    base = next(row["mean_step_s"] for row in rows if row["k"] == 1)
    out = [f"| k | mean / median time/step, steps {rows[0]['timed_steps'][0]}..{rows[0]['timed_steps'][1]} (s) | "
           "step rate vs k=1 (means) | staleness max / mean | eval accuracy at end | reward, last 3 steps | wall (s) |",
           "|---|---|---|---|---|---|---|"]
    for row in rows:
        accuracy = "n/a" if row["eval_accuracy_end"] is None else f"{row['eval_accuracy_end']:.3f}"
        out.append(f"| {row['k']} | {row['mean_step_s']:.3f} / {row['median_step_s']:.3f} | {base / row['mean_step_s']:.2f}x | "
                   f"{row['staleness_max']:.0f} / {row['staleness_mean']:.2f} | {accuracy} | "
                   f"{row['reward_last3']:.3f} | {row['wall_s']:.0f} |")
    return "\n".join(out)


def plot(rows: list[dict], args: argparse.Namespace, path: Path) -> None:
    """Time per step (the long tail shows as spikes under k = 1) and mean reward per step (the learning
    curve) of every k, side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
    for row in rows:
        steps = range(1, len(row["step_s"]) + 1)
        label = f"k = {row['k']} (mean {row['mean_step_s']:.2f} s/step)"
        left.plot(steps, row["step_s"], marker=".", label=label)
        right.plot(steps, row["reward_per_step"], marker=".", label=f"k = {row['k']}")
    left.set(xlabel="step", ylabel="time/step (s)",
             title=f"tail {args.tail} s x Pareto(1.5), update +{args.update_seconds} s")
    right.set(xlabel="step", ylabel="reward/mean", title="mean reward of the step's samples")
    left.legend(fontsize=8)
    right.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="policy folder (default: a fresh gcore-rl init-tiny)")
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="staleness bounds to run (1 is needed)")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--tail", type=float, default=0.3, help="engine.added_seconds_tail (seconds)")
    parser.add_argument("--update-seconds", type=float, default=0.0,
                        help="train.added_seconds_per_update: an update this much slower (the trainer-bound case)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--plot", type=Path, default=None,
                        help="draw time per step and reward per step of every k (PNG) here")
    args = parser.parse_args()
    if 1 not in args.ks:
        parser.error("--ks must include 1, the baseline")
    if args.steps - max(args.ks) < 5:
        parser.error("--steps must exceed the largest k by at least 5")
    with tempfile.TemporaryDirectory(prefix="staleness-") as tmp:
        work = Path(tmp)
        model = args.model.resolve() if args.model else work / "tiny"
        if args.model is None:
            cli("init-tiny", str(model), cwd=REPO)
        window = range(1, args.steps + 1)  # every step: the same N rollouts and N updates under any k
        rows = [run_one(model, work / f"k{k}", k, args.steps, args.tail, args.seed, window, args.update_seconds)
                for k in sorted(args.ks)]
    print(table(rows))
    if args.plot is not None:
        plot(rows, args, args.plot)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(args.model or "init-tiny"), "steps": args.steps,
                                        "tail_s": args.tail, "update_seconds": args.update_seconds, "seed": args.seed,
                                        "job": JOB, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
