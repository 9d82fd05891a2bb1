"""Dynamic placement with a real judge on Ray: what the run's forecast measures of each engine, and where it moves.

The job of tests/runtime/test_ray_strategies.py's real-judge test, run as a user would: 2 controllers × 3
devices (Ray logical devices), a 2-layer tiny policy writing up to 6 tokens, a 4-layer judge twice as wide
writing up to 96, 12 prompts per slice and step, starting at 2 rollout devices + 1 judge per slice. Extra
arguments are config overrides, so the same job runs under each forecast:

    .venv/bin/python benchmarks/engine_fit.py --out /tmp/engine-fit                               # counters
    .venv/bin/python benchmarks/engine_fit.py --out /tmp/engine-fit placement.forecast.model=replay \\
        placement.forecast.engine_window=2                                                      # measured shapes

Prints, per step, the split used and chosen next, the measured and predicted rollout phase, the replay's
forecast per split and the fitted engine costs (`placement/forecast/*`), and writes them as JSON
(`--json`). Timings depend on the machine and on what else runs; the decisions follow from them.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

SHOWN = ("rollout_devices", "forecast", "measured", "predicted")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="working folder (models and the run)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None, help="write the per-step placement figures here")
    parser.add_argument("overrides", nargs="*", help="config overrides (key=value)")
    args = parser.parse_args()

    import ray

    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.driver import run_job

    args.out.mkdir(parents=True, exist_ok=True)
    policy = write_tiny_model(args.out / "policy", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    judge = write_tiny_model(args.out / "deep_judge",
                             TinyModelConfig(hidden_size=64, num_layers=4, intermediate_size=128, seed=5))
    run = args.out / "run"
    cfg = load_config(JobConfig, None, [
        f"model.path={policy}", f"run.output_dir={run}", f"run.steps={args.steps}", "run.prompts_per_step=12",
        "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false",
        "runtime.kind=ray", "runtime.controllers=2", "runtime.devices_per_controller=3",
        "runtime.threads_per_process=1", "placement.strategy=dynamic", "placement.rollout_devices=2",
        "judge.enabled=true", f"judge.model_path={judge}", "judge.weight=2.0", "judge.unparsed_score=0.25",
        "judge.max_new_tokens=96", "reward.rules.0.weight=0.0", *args.overrides])
    ray.init(num_cpus=os.cpu_count(), resources={"device": 6}, include_dashboard=False, log_to_driver=False)
    try:
        run_job(cfg)
    finally:
        ray.shutdown()
    steps = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        metrics = json.loads(line)
        shown = {key.removeprefix("placement/"): value for key, value in metrics.items()
                 if key.startswith("placement/") and any(part in key for part in SHOWN)}
        steps.append({"step": metrics["step"], **shown})
        print(json.dumps(steps[-1]))
    if args.json is not None:
        args.json.write_text(json.dumps({"overrides": args.overrides, "steps": steps}, indent=1) + "\n")


if __name__ == "__main__":
    main()
