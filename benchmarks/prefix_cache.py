"""The builtin engine's prefix cache on a multi-turn job: the environment demo's GRPO steps with
`engine.prefix_cache_tokens` off and on, side by side in one run.

**Question.** A multi-turn rollout continues every trajectory after each answer of the environment; without a
cache the engine prefills the whole context again at every turn. How much rollout time and how many prefilled
positions does the cache save on the textarena demo (GuessTheNumber, a 520-token opening, four moves), and are
the records otherwise the same?

**Setup.** `gcore-rl train recipes/grpo_textarena_guess.yaml` from `--model` (the demo's warm start: `make
demo-env`, or its first two commands) for `--steps` steps, one thread, arms alternated (off, on, on, off, ...)
for `--repeats` repeats each. Per run: the median over steps 2.. of `time/rollout`, and the sums of
`work/rollout/prefill_tokens` and `work/rollout/cached_tokens`; the rewards of the two arms are compared
(the cache gives the same tokens up to fp32 round-off, so they match unless a sample lands on a rounding
boundary).

    .venv/bin/python benchmarks/prefix_cache.py --model runs/guess-sft --out bench-results/prefix_cache.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "grpo_textarena_guess.yaml"
BUDGET = 65_536
"""Positions the cache keeps in the cached arm (64 trajectories of about 650 tokens fit in 42k)."""


def run_arm(model: Path, out: Path, steps: int, cache_tokens: int) -> dict:
    """One training run; its per-step rollout time, prefill counts and rewards."""
    cmd = [sys.executable, "-m", "gcore_rl.cli", "train", str(RECIPE), f"model.path={model}",
           f"run.output_dir={out}", f"run.steps={steps}", "run.progress=false", "runtime.threads_per_process=1",
           f"engine.prefix_cache_tokens={cache_tokens}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rollout_s": statistics.median(r["time/rollout"] for r in records[1:]),
            "prefill_tokens": sum(r["work/rollout/prefill_tokens"] for r in records),
            "cached_tokens": sum(r.get("work/rollout/cached_tokens", 0.0) for r in records),
            "rewards": [r["reward/mean"] for r in records]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / "runs" / "guess-sft")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as work:
        for repeat in range(args.repeats):
            order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
            for arm in order:
                result = run_arm(args.model.resolve(), Path(work) / f"{arm}-{repeat}", args.steps,
                                 BUDGET if arm == "on" else 0)
                runs[arm].append(result)
                print(f"repeat {repeat} {arm:3s}: rollout {result['rollout_s']:.2f} s/step (median of steps 2..), "
                      f"prefilled {result['prefill_tokens']:.0f}, from the cache {result['cached_tokens']:.0f}")
    off = statistics.median(r["rollout_s"] for r in runs["off"])
    on = statistics.median(r["rollout_s"] for r in runs["on"])
    same = runs["off"][0]["rewards"] == runs["on"][0]["rewards"]
    summary = {"rollout_s_off": off, "rollout_s_on": on, "speedup": off / on,
               "prefill_tokens_off": runs["off"][0]["prefill_tokens"], "prefill_tokens_on": runs["on"][0]["prefill_tokens"],
               "cached_tokens_on": runs["on"][0]["cached_tokens"], "same_rewards": same, "runs": runs}
    print(f"rollout per step: {off:.2f} s without the cache, {on:.2f} s with it ({off / on:.2f}x); prefilled "
          f"positions {summary['prefill_tokens_off']:.0f} -> {summary['prefill_tokens_on']:.0f}; "
          f"rewards {'the same' if same else 'differ'} in both arms")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
