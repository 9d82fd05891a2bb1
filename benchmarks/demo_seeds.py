"""The demo's learning claim over seeds and thread counts: init-tiny → SFT (to its target) → RL (to its target).

The RL stage is `recipes/grpo_addition.yaml` (the demo), or any recipe that starts from the same warm
start, e.g. `--recipe recipes/ppo_addition.yaml` (PPO with a critic).

Runs the three commands of `make demo` as subprocesses, with the recipes as shipped, for every
(seed, threads) pair: the seed goes to the random model (`init-tiny seed=`), the SFT data order
(`seed=`) and GRPO's sampling and data order (`run.seed=`, `data.seed` stays so every run sees the
same prompts and held-out set); the thread count to every torch process (`threads=`,
`runtime.threads_per_process=`). Each run reports the SFT steps it took and its held-out accuracy,
GRPO's held-out accuracy before → after with the steps it took, and the wall time of each stage. An environment
job has no held-out set (`--demo env`): its rise is the mean sampled reward of the last five steps against the
first five.

    .venv/bin/python benchmarks/demo_seeds.py --seeds 0 1 2 --threads 1 2 --out bench-results/demo_seeds.json
    .venv/bin/python benchmarks/demo_seeds.py --recipe recipes/ppo_addition.yaml --out bench-results/ppo_seeds.json
    .venv/bin/python benchmarks/demo_seeds.py --lora --threads 1 --out bench-results/lora_seeds.json
    .venv/bin/python benchmarks/demo_seeds.py --engine vllm --threads 1 --out bench-results/vllm_seeds.json
    .venv/bin/python benchmarks/demo_seeds.py --demo env --threads 1 --out bench-results/env_seeds.json

prints a Markdown table (the one in docs/getting-started.md) and writes the raw figures as JSON. The slow test
`tests/test_demo_seeds.py` runs the same function and asserts the rise on every row.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SFT_RECIPE = REPO / "recipes" / "sft_addition.yaml"
GRPO_RECIPE = REPO / "recipes" / "grpo_addition.yaml"


@dataclass(frozen=True)
class Demo:
    """A demo pipeline: the tiny model's `init-tiny` options, the warm start's recipe and the RL recipe."""

    init: tuple[str, ...]
    sft: Path
    rl: Path
    rm: Path | None = None  # a reward model trained from the warm start, which the RL stage is rewarded by


DEMOS = {
    "addition": Demo((), SFT_RECIPE, GRPO_RECIPE),
    "vision": Demo(("arch=qwen2_vl",), REPO / "recipes" / "sft_vision_shapes.yaml",
                   REPO / "recipes" / "grpo_vision_shapes.yaml"),
    "vision_rm": Demo(("arch=qwen2_vl",), REPO / "recipes" / "sft_vision_shapes.yaml",
                      REPO / "recipes" / "grpo_vision_shapes_rm.yaml", REPO / "recipes" / "rm_vision_shapes.yaml"),
    "gym": Demo((), REPO / "recipes" / "sft_gym_arithmetic.yaml", REPO / "recipes" / "grpo_gym_arithmetic.yaml"),
    "reversal": Demo((), REPO / "recipes" / "sft_reversal.yaml", REPO / "recipes" / "grpo_reversal.yaml"),
    "agent": Demo(("tool_tokens=true",), REPO / "recipes" / "sft_agent_mul.yaml", REPO / "recipes" / "grpo_agent_mul.yaml"),
    "env": Demo(("max_positions=1024",), REPO / "recipes" / "sft_textarena_guess.yaml",
                REPO / "recipes" / "grpo_textarena_guess.yaml"),
}
"""`make demo` (2-digit addition), `make demo-vision` (counting shapes with a vision-language policy) and a
reasoning-gym task scored by its own scorer (`basic_arithmetic`, the tasks extra), string reversal with partial
credit (`recipes/grpo_reversal.yaml`, 60 steps, no stop criterion), `make demo-agent` (4-digit
multiplication through the `mul` tool), `make demo-env` (a textarena game, GuessTheNumber; the agents extra), and the
counting task rewarded by a vision reward model trained from each warm start (`vision_rm`: init → SFT → RM → GRPO)."""


@dataclass
class DemoRun:
    """One pass of the demo pipeline (accuracies are greedy exact match on the 256 held-out prompts; a demo without
    held-out prompts reports the mean sampled reward of its first and last five RL steps instead)."""

    seed: int
    threads: int
    sft_steps: int
    sft_accuracy: float | None  # None: the warm start has no held-out criterion (it runs its steps)
    grpo_steps: int
    eval_before: float
    eval_after: float
    sft_seconds: float
    grpo_seconds: float
    measure: str = "eval accuracy before → after"
    # tool-using recipes: tool calls per trajectory of the warm start (`tool_probe`) and at the last RL step,
    # and the share of the warm start's calls that failed
    # a pipeline with a reward model: its held-out pair accuracy (as saved) and its training steps
    rm_accuracy: float | None = None
    rm_steps: int | None = None
    calls_first: float | None = None
    calls_last: float | None = None
    call_errors_first: float | None = None

    @property
    def rise(self) -> float:
        return self.eval_after - self.eval_before


LORA = ["model.lora.enabled=true", "model.lora.rank=16", "model.lora.alpha=32", "train.lr=0.003"]
"""`--lora`: the RL stage trains rank-16 adapters (docs/memory.md), at ten times the recipe's learning rate."""
CONTROL = ["rollout.options.tools=[agent_control:mul]", "run.steps=20"]
"""`--control` for the agent demo: its tool never answers (benchmarks/agent_control.py), 20 steps (twice what the
real tool needs to reach the target)."""


def _run(args: list[str], cwd: Path) -> float:
    """Run `gcore-rl ARGS` in `cwd`; returns its wall time. Raises with the output when it fails."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO / "benchmarks"), os.environ.get("PYTHONPATH")) if p))  # agent_control's tool
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"gcore-rl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def run_demo(seed: int, threads: int, work: Path, recipe: Path | None = None, demo: Demo = DEMOS["addition"],
             rl_overrides: tuple[str, ...] = (), sft_overrides: tuple[str, ...] = ()) -> DemoRun:
    """The pipeline of `demo` in `work` with one seed and thread count; `recipe` replaces its RL stage, and
    `sft_overrides` and `rl_overrides` are added to the command lines of the warm start and the RL stage."""
    recipe = recipe or demo.rl
    work.mkdir(parents=True, exist_ok=True)
    _run(["init-tiny", "base", f"seed={seed}", *demo.init], work)
    sft_s = _run(["sft", str(demo.sft), "model.path=base", "output_dir=sft", f"seed={seed}", f"threads={threads}",
                  "progress=false", *sft_overrides], work)
    if demo.rm is not None:  # counted with the warm start: both come before the RL stage
        sft_s += _run(["rm", str(demo.rm), "model.path=sft", "output_dir=rm", f"seed={seed}", f"threads={threads}",
                       "progress=false"], work)
        rl_overrides = ("reward_model.model_path=rm", *rl_overrides)
    grpo_s = _run(["train", str(recipe), "model.path=sft", "run.output_dir=grpo", f"run.seed={seed}",
                   f"runtime.threads_per_process={threads}", "run.progress=false", *rl_overrides], work)
    sft_evals = [row["sft/eval_accuracy"] for row in _jsonl(work / "sft" / "sft_metrics.jsonl") if "sft/eval_accuracy" in row]
    grpo = _jsonl(work / "grpo" / "metrics.jsonl")
    if "eval/accuracy" in grpo[-1]:
        scores = {"eval_before": _held_out_before(work / "grpo"), "eval_after": grpo[-1]["eval/accuracy"]}
    else:  # an environment job: no held-out prompts
        scores = {"eval_before": _mean(r["reward/mean"] for r in grpo[:5]),
                  "eval_after": _mean(r["reward/mean"] for r in grpo[-5:]), "measure": REWARD_MEASURE}
    tools = {}
    if demo.rm is not None:
        rm = json.loads((work / "rm" / "rm_summary.json").read_text())
        tools.update(rm_accuracy=rm["eval/accuracy"], rm_steps=rm["steps"])
    if "rollout/tool_calls" in grpo[0]:
        calls, errors = tool_probe(work, recipe, threads)
        tools = {"calls_first": calls, "calls_last": grpo[-1]["rollout/tool_calls"], "call_errors_first": errors}
    return DemoRun(seed=seed, threads=threads, sft_steps=_jsonl(work / "sft" / "sft_metrics.jsonl")[-1]["step"],
                   sft_accuracy=sft_evals[-1] if sft_evals else None, grpo_steps=grpo[-1]["step"], sft_seconds=sft_s,
                   grpo_seconds=grpo_s, **scores, **tools)


REWARD_MEASURE = "mean reward, steps 1–5 → last 5"
"""What `DemoRun.eval_before`/`eval_after` hold for a job without held-out prompts."""


def _mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def tool_probe(work: Path, recipe: Path, threads: int) -> tuple[float, float]:
    """(tool calls per trajectory, share of calls that failed) of the warm start `work/sft`, sampled as the RL
    recipe samples (temperature, tools) over one step's prompts, every trajectory counted: the rollout of one
    step with dynamic sampling off (which keeps only groups whose rewards differ, and so over-represents calls);
    the step's update comes after its rollout and is thrown away."""
    _run(["train", str(recipe), "model.path=sft", "run.output_dir=probe", "run.steps=1", "run.eval_every=0",
          "data.eval_prompts=0", "run.stop_at_eval_accuracy=0", "dynamic_sampling.enabled=false",
          "run.save_final=false", f"runtime.threads_per_process={threads}", "run.progress=false"], work)
    (record,) = _jsonl(work / "probe" / "metrics.jsonl")
    return record["rollout/tool_calls"], record["rollout/tool_errors"] / max(record["rollout/tool_calls"], 1e-9)


def _held_out_before(run_dir: Path) -> float:
    """GRPO's held-out accuracy before its first step (written by the run to summary.json)."""
    return json.loads((run_dir / "summary.json").read_text())["eval_accuracy_before"]


def table(runs: list[DemoRun]) -> str:
    """The Markdown table of docs/getting-started.md."""
    lines = [f"| seed | threads | SFT steps → held-out acc. | RL steps | {runs[0].measure} | rise | SFT + RL wall |",
             "|---|---|---|---|---|---|---|"]
    tools = any(r.calls_first is not None for r in runs)
    reward_model = any(r.rm_accuracy is not None for r in runs)
    if reward_model:
        lines[0] += " reward model: steps → held-out pair acc. |"
        lines[1] += "---|"
    if tools:
        lines[0] += " tool calls per trajectory, first → last step | failed calls, first step |"
        lines[1] += "---|---|"
    for r in runs:
        sft = f"{r.sft_steps} → {r.sft_accuracy:.3f}" if r.sft_accuracy is not None else f"{r.sft_steps} → —"
        line = (f"| {r.seed} | {r.threads} | {sft} | {r.grpo_steps} | {r.eval_before:.3f} → {r.eval_after:.3f} | "
                f"{r.rise:+.3f} | {r.sft_seconds:.0f} s + {r.grpo_seconds:.0f} s |")
        if reward_model:
            line += f" {r.rm_steps} → {r.rm_accuracy:.3f} |"
        if tools and r.calls_first is not None:
            line += f" {r.calls_first:.2f} → {r.calls_last:.2f} | {r.call_errors_first:.2f} |"
        lines.append(line)
    rises = [r.rise for r in runs]
    lines.append(f"\nrise min {min(rises):.3f}, max {max(rises):.3f}; after min {min(r.eval_after for r in runs):.3f}, "
                 f"max {max(r.eval_after for r in runs):.3f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--demo", choices=sorted(DEMOS), default="addition", help="Which demo pipeline (default: make demo's).")
    parser.add_argument("--recipe", type=Path, default=None, help="The RL stage's recipe (default: the demo's GRPO).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--work-dir", default=None, help="Where the runs go (default: a new temporary directory).")
    parser.add_argument("--out", default=None, help="Write the raw figures here as JSON.")
    parser.add_argument("--control", action="store_true", help="--demo agent: the control, a tool that never answers.")
    parser.add_argument("--lora", action="store_true", help="The RL stage trains LoRA adapters (`LORA`).")
    parser.add_argument("--engine", default="builtin", help="The RL stage's engine.backend (e.g. vllm, after `make vllm-env`).")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="demo-seeds-"))
    runs = []
    for seed in args.seeds:
        for threads in args.threads:
            runs.append(run_demo(seed, threads, work / f"seed{seed}-threads{threads}",
                                 args.recipe.resolve() if args.recipe else None, DEMOS[args.demo],
                                 (*(CONTROL if args.control else ()), *(LORA if args.lora else ()),
                                  f"engine.backend={args.engine}")))
            print(table(runs[-1:]).splitlines()[2], flush=True)
    recipe = args.recipe or DEMOS[args.demo].rl
    print(f"\n{recipe.name}: {date.today()}, {platform.machine()} {os.cpu_count()} cores, {platform.processor() or 'cpu'}\n")
    print(table(runs))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([asdict(r) | {"rise": r.rise} for r in runs], indent=2))


if __name__ == "__main__":
    main()
