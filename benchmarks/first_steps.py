"""How healthy were a run's first steps? One Markdown row per run directory: the largest approx_kl and clip
fraction of the first N steps and of the whole run, the sampled reward at step 1 and its lowest value in them, the held-out
accuracy before training and at the run's evaluations, and every step the health checks flag
(`gcore_rl.telemetry.health`, the run's own `run.health` thresholds), over the whole run.

    python benchmarks/first_steps.py RUN_DIR [RUN_DIR ...] [--steps 10]

The table of BENCHMARKS.md "Healthy first steps" was printed by it. A diffusion run (`flow_grpo`) writes its
update's statistics as `train/<name>` and its held-out evaluation before training as step 0; they are read as
a language run's (`approx_kl`, ...) so that the same checks apply.
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


def _as_language_line(line: dict) -> dict:
    """A metrics line with the `train/<name>` statistics of a diffusion run recorded before 2026-12-06 also under
    `<name>` (diffusion runs name them as language runs do since)."""
    return {**{key.removeprefix("train/"): value for key, value in line.items() if key.startswith("train/")}, **line}


def row(run_dir: Path, steps: int) -> str:
    run = load_run(run_dir)
    trained = [_as_language_line(line) for line in run.metrics if "reward/mean" in line]
    first = trained[:steps]
    rewards = [line["reward/mean"] for line in first]
    before = (run.summary or {}).get("eval_accuracy_before")
    if before is None:  # a diffusion run recorded before 2026-12-06 evaluated before its first step as step 0
        before = next((line["eval/accuracy"] for line in run.metrics if line.get("step") == 0 and "eval/accuracy" in line),
                      None)
    evals = ", ".join(f"{line['step']}: {line['eval/accuracy']:.3f}" for line in trained if "eval/accuracy" in line)
    held_out = f"{before:.3f} → {evals}" if isinstance(before, (int, float)) else "—"  # an environment job has none
    flags = run_flags(trained, run_health(run), before if isinstance(before, (int, float)) else None)
    flagged = "; ".join(str(flag) for flag in flags[:5]) + (f" (+{len(flags) - 5})" if len(flags) > 5 else "")
    name = "/".join(run_dir.parts[-2:])  # e.g. seed0-threads2/grpo, as demo_seeds.py lays runs out
    return (f"| {name} | {len(trained)} | {_largest(first, 'approx_kl'):.3f} ({_largest(trained, 'approx_kl'):.3f}) | "
            f"{_largest(first, 'clip_fraction'):.3f} ({_largest(trained, 'clip_fraction'):.3f}) | "
            f"{rewards[0]:.3f} → min {min(rewards):.3f} | {held_out} | {flagged or 'none'} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", type=Path, nargs="+")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"| run | steps | approx_kl max, first {args.steps} (whole run) | clip fraction max, first {args.steps} (whole run) | "
          f"reward step 1 → min of the first {args.steps} | "
          "held-out before → step: accuracy | flagged steps (whole run) |")
    print("|---|---|---|---|---|---|---|")
    for run_dir in args.runs:
        print(row(run_dir, args.steps))


if __name__ == "__main__":
    main()
