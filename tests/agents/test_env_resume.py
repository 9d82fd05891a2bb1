"""An environment job killed with SIGKILL resumes to the identical record: the episodes' draws follow the step's
seeds, every game keeps its own random state, and under bounded staleness (k = 2, on Ray, slow) the multi-turn
rollouts made ahead of the trainer are saved in the checkpoint with their masks and per-turn rewards."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from cli_helpers import TINY_SHAPE, gcore_rl

pytest.importorskip("textarena")
HERE = Path(__file__).resolve().parent
RECIPE = HERE.parents[1] / "recipes" / "grpo_textarena_guess.yaml"
UNTIMED = ("time", "throughput/", "util/", "memory/")
JOB = ["model.path=tiny", "run.steps=4", "run.checkpoint_every=2", "run.prompts_per_step=2", "sampling.n=4",
       "run.progress=false", "runtime.threads_per_process=1", "engine.backend=move_backend:build", "train.lr=0.01",
       "data.num_prompts=64"]


def train(workdir: Path, out: Path, *extra: str, fault: str | None = None):
    return gcore_rl("train", RECIPE, f"run.output_dir={out}", *JOB, *extra, cwd=workdir, extra_pythonpath=HERE,
                    fault=fault)


def records(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
            for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("env-resume")
    proc = gcore_rl("init-tiny", "tiny", *TINY_SHAPE, "max_positions=1024", cwd=root)
    assert proc.returncode == 0, proc.stderr
    return root


@pytest.mark.slow  # three runs through the command line (about 20 s): `make test-slow`
def test_a_killed_environment_run_resumes_to_the_same_record(workdir):
    whole = train(workdir, workdir / "whole")
    assert whole.returncode == 0, whole.stderr
    expected = records(workdir / "whole")
    assert all(m["rollout/turns"] > 1 for m in expected) and len({m["pg_loss"] for m in expected}) > 1
    killed = train(workdir, workdir / "killed", fault="generate:4")  # step 2's save completes at the end of step 3
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = train(workdir, workdir / "killed", "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing from" in resumed.stdout and "step-00000002" in resumed.stdout
    assert records(workdir / "killed") == expected


@pytest.mark.slow
def test_rollouts_made_ahead_are_saved_with_their_turns_and_resume_exactly_on_ray(workdir):
    ray_job = ["runtime.kind=ray", "runtime.devices_per_controller=2", "placement.strategy=disaggregated",
               "placement.max_staleness=2", "run.steps=5"]
    whole = train(workdir, workdir / "ray-whole", *ray_job)
    assert whole.returncode == 0, whole.stderr
    killed = train(workdir, workdir / "ray-killed", *ray_job, fault="train:4")  # SIGKILL of the trainer's actor
    assert killed.returncode == 1 and "died" in killed.stderr, killed.stderr
    saved = json.loads(next((workdir / "ray-killed" / "checkpoints").glob("step-*/controller-0.json")).read_text())
    ahead = [c for rollout in saved["ahead"] for group in rollout["groups"] for c in group["payload"]["completions"]]
    assert ahead and all(0 in c["loss_mask"] for c in ahead)  # multi-turn trajectories, the game's answers masked
    resumed = train(workdir, workdir / "ray-killed", *ray_job, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert records(workdir / "ray-killed") == records(workdir / "ray-whole")
