"""Dynamic placement of a diffusion job against every static split, on Ray, with one side made slow.

One controller with a slice of 4 devices (Ray, logical devices on the CPU), the tiny flow policy and a tiny
ViT image reward model; each step samples `--prompts` prompts x 2 images in chunks of 2. One side of the
rollout phase is made slow by an injected delay (the other costs the tiny models' milliseconds):

* ``sampling``: `sampling.added_seconds_per_chunk` (each chunk sampled takes that much longer);
* ``scoring``: `reward_model.added_seconds_per_image` (each image scored takes that much longer).

For each case the job runs under `partial` at every split (1, 2, 3 sampling devices of 4) and under
`dynamic` started from the worst of them. Reported: the median `time/rollout` of steps 2..N of each
run (the dynamic run's step 1 is its measurement at the bad start), and dynamic's ratio to the best static
split. Run from the repository root (about 6 minutes on 2 cores):

    .venv/bin/python benchmarks/flow_dynamic.py --out bench-results/flow_dynamic.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CASES = {"sampling": "sampling.added_seconds_per_chunk={delay}",
         "scoring": "reward_model.added_seconds_per_image={half}"}
"""The injected delay of each case: per chunk sampled, or per image scored (half as much: 2 images a chunk)."""


def run(work: Path, name: str, overrides: list[str]) -> list[dict]:
    """One job; its metrics lines of steps 1..N."""
    from gcore_rl.configlib import load_config
    from gcore_rl.diffusion.config import FlowGrpoJobConfig
    from gcore_rl.runtime.driver import run_job

    out = work / name
    cfg = load_config(FlowGrpoJobConfig, REPO / "recipes" / "flow_grpo_shapes.yaml",
                      [f"run.output_dir={out}", "run.progress=false", "run.stop_at_eval_reward=0", "run.eval_every=1000",
                       "run.save_final=false", "data.eval_prompts=1", "sampling.eval_steps=2", "runtime.kind=ray",
                       "runtime.threads_per_process=1", "runtime.devices_per_controller=4", *overrides])
    run_job(cfg)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=6, help="prompts per step (x 2 images, chunks of 2)")
    parser.add_argument("--delay", type=float, default=0.4, help="injected seconds per chunk on the slow side")
    args = parser.parse_args()

    import ray

    from gcore_rl.models.flow import TinyDiffusionConfig, write_tiny_diffusion

    result: dict = {"steps": args.steps, "prompts": args.prompts, "delay_s_per_chunk": args.delay, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="flow-dynamic-") as tmp:
        work = Path(tmp)
        policy = write_tiny_diffusion(work / "policy", TinyDiffusionConfig(resolution=8, num_layers=1))
        from transformers import ViTConfig, ViTForImageClassification

        ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                            num_attention_heads=2, intermediate_size=32, num_labels=1)
                                  ).save_pretrained(work / "rm")
        common = [f"model.path={policy}", f"reward_model.model_path={work / 'rm'}", f"run.steps={args.steps}",
                  f"run.prompts_per_step={args.prompts}", "sampling.n=2", "sampling.batch_size=2", "sampling.steps=2",
                  "sampling.resolution=8"]
        ray.init(num_cpus=2, resources={"device": 4}, include_dashboard=False, log_to_driver=False)
        try:
            for case, delay in CASES.items():
                slow = [delay.format(delay=args.delay, half=args.delay / 2)]
                static = {}
                for rollout in (1, 2, 3):
                    lines = run(work, f"{case}-partial-{rollout}", [*common, *slow, "placement.strategy=partial",
                                                                   f"placement.rollout_devices={rollout}"])
                    static[rollout] = statistics.median(line["time/rollout"] for line in lines[1:])  # steps 2 on
                worst = max(static, key=static.get)
                lines = run(work, f"{case}-dynamic", [*common, *slow, "placement.strategy=dynamic",
                                                      f"placement.rollout_devices={worst}"])
                dynamic = statistics.median(line["time/rollout"] for line in lines[1:])
                best = min(static, key=static.get)
                result["cases"][case] = {
                    "static_rollout_s": static, "best_static": best, "dynamic_start": worst,
                    "dynamic_splits": [int(line["placement/rollout_devices"]) for line in lines],
                    "dynamic_rollout_s": dynamic, "dynamic_over_best_static": dynamic / static[best]}
                print(json.dumps({case: result["cases"][case]}), flush=True)
        finally:
            ray.shutdown()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
