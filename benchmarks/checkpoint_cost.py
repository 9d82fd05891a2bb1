"""What checkpoints cost: the step time a save adds, how long the write takes in the background, and how
long a resume takes, for the demo job and for a Qwen2-0.5B-shaped trainer.

Two parts, side by side in one invocation:

* ``job``: the real trainer (`gcore-rl train`, local runtime, one controller) on the init-tiny default
  model (hidden 128, 4 layers) with the demo recipe's sampling and batch, run without checkpoints and
  with a save after every `EVERY`-th step, written as `run.checkpoint_write=auto` decides, by the writer
  thread and in line, `--repeats` times each, alternating. A save costs the seconds it holds the
  controller (`time/checkpoint`: staging the trainer's shards to host memory, an in-line write, the
  controller's state) plus what its later work takes from the steps after it: waiting for a writer
  thread (at the end of the step after the save), and the manifest's checksums, fsyncs and the pruning,
  which run in a thread from there on, during the second step after the save. The steps of a run are
  therefore told apart by their position in the save cycle: 1 and 2 carry a save's later work, 3 and 4
  nothing of it (the step that ends with the next save stops its `time/step` before that save starts),
  and `clean_positions_gap_s`, the difference of their medians, shows it. A save adds what it holds
  plus, for positions 1 and 2, the median `time/step` less that of positions 3 and 4 together, measured
  inside each run: runs of one job drift by several percent from one to the next on a shared 2-core
  machine, the steps of one run by about one, so comparing steps of one run measures a cost of a few
  percent where comparing runs cannot. Reported per mode: the median over runs of the seconds held, of
  the steps' extra time, of their sum (the time a save adds) and of its fraction of the clean step, and
  each run's figures; the median `time/step` of the runs without checkpoints beside them; and the wall
  time of a resume (`run.resume=auto` from the last checkpoint, one more step) against a fresh start of
  the same one-step job.
* ``trainer``: a `PolicyTrainer` of the given shape (default Qwen2-0.5B: hidden 896, 24 layers, 14/2
  heads, MLP 4864, vocabulary 151936; float32 weights and AdamW moments) in one process (FSDP2 over a
  gloo group of 1), after one update so the optimiser state exists. Reported: bytes written, the
  seconds `TrainerCheckpointer.save` blocks (staging) at the first save and at later ones (which
  reuse the host buffers), the seconds of the background write after it
  (`wait`), a blocking `dcp.save` of the same state for comparison, the manifest's checksums
  (`finalize`), and `TrainerCheckpointer.load` into a fresh trainer; medians over `--repeats`.

Run from the repository root on a quiet machine:

    .venv/bin/python benchmarks/checkpoint_cost.py --out bench-results/checkpoint_cost.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QWEN2_05B = ["hidden_size=896", "num_layers=24", "num_heads=14", "num_kv_heads=2", "intermediate_size=4864",
             "vocab_size=151936", "arch=qwen2", "max_positions=512"]
EVERY = 4
"""The demo-job runs save after every `EVERY`-th step: one step for a save's write to be waited for, one for its
manifest thread, and two clean ones."""
RUNS = {"none": ["run.checkpoint_every=0"],
        "auto": [f"run.checkpoint_every={EVERY}"],
        "background": [f"run.checkpoint_every={EVERY}", "run.checkpoint_write=background"],
        "blocking": [f"run.checkpoint_every={EVERY}", "run.checkpoint_write=blocking"]}
"""The demo-job runs, alternated within each repeat: no checkpoints, saves as the default writes them, and
the same written by the writer thread and in line."""
JOB = ["run.prompts_per_step=64", "sampling.n=8", "run.progress=false", "run.stop_at_eval_accuracy=0",
       "data.eval_prompts=0", "dynamic_sampling.enabled=false", "run.save_final=false", "runtime.threads_per_process=2"]


def cli(*args: str, cwd: Path) -> float:
    """Run `gcore-rl ARGS` and return its wall time (raises when it fails)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "gcore_rl.cli", *args], cwd=cwd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"gcore-rl {' '.join(args)} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def run_times(out: Path) -> dict[str, list[float]]:
    """A run folder's `time/checkpoint` of every save (``"held"``) and the `time/step` of every step from the
    first save on by its position in the save cycle (``"1"`` the step right after a save .. ``"EVERY"`` the
    step that ends with the next save)."""
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times: dict[str, list[float]] = {"held": [m["time/checkpoint"] for m in lines if "time/checkpoint" in m]}
    for m in lines:
        if m["step"] > EVERY:
            times.setdefault(str((m["step"] - 1) % EVERY + 1), []).append(m["time/step"])
    return times


CARRIED = ("1", "2")
"""Positions in the save cycle that carry a save's later work (see the module docstring); the others are clean."""


def added_by_a_save(run: dict[str, list[float]]) -> tuple[float, float, float]:
    """(the clean step, the extra seconds the steps that carry a save's work take over it, the gap between the
    medians of the clean positions) of one run (`run_times`)."""
    median = statistics.median
    clean = [str(position) for position in range(1, EVERY + 1) if str(position) not in CARRIED]
    base = median(t for position in clean for t in run[position])
    gap = median(run[clean[0]]) - median(run[clean[-1]])
    return base, sum(median(run[position]) - base for position in CARRIED), gap


def job_part(work: Path, steps: int, repeats: int) -> dict:
    """Step time without checkpoints and what a save adds in each write mode, and a resume against a fresh start."""
    cli("init-tiny", "model", cwd=work)
    recipe = str(REPO / "recipes" / "grpo_addition.yaml")
    runs: dict[str, list[dict[str, list[float]]]] = {name: [] for name in RUNS}
    resume_s, fresh_s = [], []
    for repeat in range(repeats):
        for name, extra in RUNS.items():
            out = work / f"job-{name}-{repeat}"
            cli("train", recipe, "model.path=model", f"run.output_dir={out}", f"run.steps={steps}",
                "run.keep_checkpoints=1", *extra, *JOB, cwd=work)
            runs[name].append(run_times(out))
        out = work / f"job-auto-{repeat}"
        resume_s.append(cli("train", recipe, "model.path=model", f"run.output_dir={out}", f"run.steps={steps + 1}",
                            "run.checkpoint_every=0", "run.resume=auto", *JOB, cwd=work))
        fresh_s.append(cli("train", recipe, "model.path=model", f"run.output_dir={work / f'fresh-{repeat}'}",
                           "run.steps=1", *JOB, cwd=work))
    median = statistics.median
    result = {"steps": steps, "repeats": repeats, "save_every": EVERY,
              "step_without_checkpoints_s": median(t for run in runs["none"] for key, values in run.items()
                                                 if key != "held" for t in values),
              "resume_one_step_wall_s": median(resume_s), "fresh_one_step_wall_s": median(fresh_s),
              "checkpoint_bytes": sum(p.stat().st_size for p in (work / "job-auto-0" / "checkpoints").rglob("*")
                                      if p.is_file())}
    for name in ("auto", "background", "blocking"):
        per_run = [(median(run["held"]), *added_by_a_save(run)) for run in runs[name]]  # (held, base, extra, gap)
        held, base, extra, gap = (median(values) for values in zip(*per_run, strict=True))
        result[name] = {"save_held_s": held, "steps_extra_s": extra, "clean_step_s": base, "clean_positions_gap_s": gap,
                        "added_per_save_s": median(h + e for h, _, e, _ in per_run),
                        "added_fraction": median((h + e) / b for h, b, e, _ in per_run),
                        "per_run": [{"held_s": h, "clean_step_s": b, "steps_extra_s": e, "clean_positions_gap_s": g,
                                     "added_fraction": (h + e) / b} for h, b, e, g in per_run]}
    return result


def trainer_part(work: Path, shape: list[str], repeats: int, device_name: str = "cpu") -> dict:
    """Save, write, checksum and load times of one trainer's state (see the module docstring); on CUDA the
    trainer's tensors live on the GPU and staging is a device-to-host copy into pinned buffers."""
    import torch
    import torch.distributed.checkpoint as dcp

    from gcore_rl.algos.config import AlgoConfig
    from gcore_rl.checkpoint.manifest import finalize
    from gcore_rl.distributed import destroy_process_group, free_port, init_process_group
    from gcore_rl.records import Completion, build_token_batch
    from gcore_rl.training.actor import TrainConfig
    from gcore_rl.training.policy_trainer import PolicyTrainer
    from gcore_rl.training.trainer_checkpoint import TrainerCheckpointer, split_state

    cli("init-tiny", "big", *shape, cwd=work)
    device = torch.device(device_name)
    init_process_group(0, 1, free_port(), device)

    def build() -> PolicyTrainer:
        return PolicyTrainer.build(work / "big", dtype="float32", attn_implementation="sdpa", reference_path=None,
                                   train=TrainConfig(micro_batch_size=2), algo=AlgoConfig(), logprob_temperature=1.0,
                                   device=device, bf16=False)

    try:
        trainer = build()
        completions = [Completion(i, [5 + i] * 16, [7] * 16, [-1.0] * 16, "length") for i in range(2)]
        batch = build_token_batch(completions, 0)
        batch.advantages = torch.tensor([1.0, -1.0])
        trainer.update(batch, trainer.prepare(batch))  # the optimiser state exists from here on
        stage, write, blocking, checksum, load = [], [], [], [], []
        checkpointer = TrainerCheckpointer()  # one per trainer for the whole run: later saves reuse its host buffers
        for repeat in range(repeats):
            folder = work / f"step-{repeat + 1:08d}.incomplete"
            started = time.perf_counter()
            checkpointer.save(trainer, folder, "trainer", "trainer.json")
            stage.append(time.perf_counter() - started)
            write.append(checkpointer.wait())
            started = time.perf_counter()
            dcp.save(split_state(trainer.state_dict())[0], checkpoint_id=work / f"blocking-{repeat}")
            blocking.append(time.perf_counter() - started)
            started = time.perf_counter()
            final = finalize(folder, step=repeat + 1, config_sha256="0" * 64, controllers=1, trainer_devices=1,
                             devices=1, frozen=[])
            checksum.append(time.perf_counter() - started)
            shutil.rmtree(work / f"blocking-{repeat}")
            if repeat < repeats - 1:
                shutil.rmtree(final)  # one 0.5B checkpoint is 6 GiB: keep only the last, for the load
        checkpointer.close()
        del checkpointer  # its host buffers: a second trainer must fit in memory next to the first
        size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
        params = sum(p.numel() for p in trainer.model.parameters())
        for _ in range(repeats):
            fresh = build()
            started = time.perf_counter()
            TrainerCheckpointer().load(fresh, final, "trainer", "trainer.json")
            load.append(time.perf_counter() - started)
            del fresh
    finally:
        destroy_process_group()
    return {"shape": shape, "device": device_name, "parameters": params, "repeats": repeats, "checkpoint_bytes": size,
            "first_save_blocks_s": stage[0], "later_saves_block_s": statistics.median(stage[1:] or stage),
            "background_write_s": statistics.median(write),
            "blocking_dcp_save_s": statistics.median(blocking), "manifest_checksums_s": statistics.median(checksum),
            "load_s": statistics.median(load)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=28, help="Steps of each demo-job run.")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--trainer-repeats", type=int, default=3)
    parser.add_argument("--shape", nargs="*", default=QWEN2_05B, help="init-tiny options of the trainer part's model.")
    parser.add_argument("--skip-job", action="store_true")
    parser.add_argument("--skip-trainer", action="store_true")
    parser.add_argument("--device", default="cpu", help="The trainer part's device: cpu, or cuda (the trainer's state "
                        "on the GPU, staged into pinned host buffers).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="checkpoint-cost-") as tmp:
        work = Path(tmp)
        result = {"python": sys.version.split()[0]}
        if not args.skip_job:
            result["job"] = job_part(work, args.steps, args.repeats)
            print(json.dumps(result["job"], indent=1), flush=True)
        if not args.skip_trainer:
            result["trainer"] = trainer_part(work, args.shape, args.trainer_repeats, args.device)
            print(json.dumps(result["trainer"], indent=1), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
