"""How healthy were a run's first steps? One Markdown row per run directory: the largest approx_kl and clip
fraction of the first N steps, the sampled reward at step 1 and its lowest value in them, the held-out
accuracy before training and at the run's evaluations, and every step the health checks flag
(`gcore_rl.telemetry.health`, the run's own `run.health` thresholds), over the whole run.

    python benchmarks/first_steps.py RUN_DIR [RUN_DIR ...] [--steps 10]

The table of BENCHMARKS.md "Healthy first steps" was printed by it.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from gcore_rl.report.run_report import run_health
from gcore_rl.report.rundata import load_run
from gcore_rl.telemetry.health import run_flags


def _largest(lines: list[dict], key: str) -> float:
    values = [line[key] for line in lines if isinstance(line.get(key), (int, float)) and not math.isnan(line[key])]
    return max(values) if values else math.nan


def row(run_dir: Path, steps: int) -> str:
    run = load_run(run_dir)
    first = run.metrics[:steps]
    rewards = [line["reward/mean"] for line in first]
    before = (run.summary or {}).get("eval_accuracy_before")
    evals = ", ".join(f"{line['step']}: {line['eval/accuracy']:.3f}" for line in run.metrics if "eval/accuracy" in line)
    flags = run_flags(run.metrics, run_health(run), before if isinstance(before, (int, float)) else None)
    flagged = "; ".join(str(flag) for flag in flags[:5]) + (f" (+{len(flags) - 5})" if len(flags) > 5 else "")
    return (f"| {run_dir.name} | {len(run.metrics)} | {_largest(first, 'approx_kl'):.3f} | "
            f"{_largest(first, 'clip_fraction'):.3f} | {rewards[0]:.3f} → min {min(rewards):.3f} | "
            f"{before if before is None else f'{before:.3f}'} → {evals} | {flagged or 'none'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"| run | steps | approx_kl max (first {args.steps}) | clip fraction max | reward step 1 → min | "
          "held-out before → step: accuracy | flagged steps (whole run) |")
    print("|---|---|---|---|---|---|---|")
    for run_dir in args.runs:
        print(row(run_dir, args.steps))


if __name__ == "__main__":
    main()
