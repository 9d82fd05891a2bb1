"""Kill a run (SIGKILL, at a named phase of a named step) and resume it: the per-step record must equal
that of the uninterrupted run, bit for bit, and every prompt must be drawn exactly as it was.

Local runtime, one controller, through the real command line: the job checkpoints every 2 steps
with dynamic sampling on (so surplus groups sit in the wave buffer across a save), and the fault
hits during generation, training, the weight sync and a save. The save of step N is written
while step N + 1 runs and completed at its end, so a kill in step 5 (or while step 4's save
starts) leaves `step-00000004.incomplete` and the resume falls back to step 2; a kill in step 6
resumes from step 4 (or from step 2, when the kill came before the background thread had
renamed step 4's folder).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import RECIPE, TIMEOUT_S, gcore_rl, init_tiny

from gcore_rl.checkpoint.layout import step_dir

STEPS = 6
JOB = [f"run.steps={STEPS}", "run.checkpoint_every=2", "run.keep_checkpoints=2", "run.prompts_per_step=4", "sampling.n=4",
       "run.progress=false", "runtime.threads_per_process=1", "run.stop_at_eval_accuracy=0", "data.eval_prompts=8",
       "run.eval_every=3", "reward.rules.0.fn=digits:fraction", "reward.accuracy_fn=digits:fraction",
       "dynamic_sampling.enabled=true", "dynamic_sampling.oversampling=1.5", "train.mini_batches=2",
       "train.target_kl=1e-6"]  # a KL target every update passes: the rate moves each step, and must resume
UNTIMED = ("time", "throughput/", "util/", "memory/")
"""Metrics that measure the machine rather than the run (left out of the comparison)."""
DIGITS_REWARD = "def fraction(prompt, completion, **row):\n    return sum(c.isdigit() for c in completion) / 6\n"


def train(workdir: Path, out: Path, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    return gcore_rl("train", RECIPE, "model.path=tiny", f"run.output_dir={out}", *JOB, *extra, cwd=workdir,
                    extra_pythonpath=workdir, fault=fault)


def records(out: Path) -> tuple[list[dict], list[dict]]:
    """The run's metrics without the machine-dependent ones, and its prompt rows per step."""
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (out / "prompts" / "controller-0.jsonl").read_text().splitlines()]
    return metrics, prompts


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    init_tiny(root)
    (root / "digits.py").write_text(DIGITS_REWARD)
    return root


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    out = workdir / "uninterrupted"
    proc = train(workdir, out)
    assert proc.returncode == 0, proc.stderr
    metrics, prompts = records(out)
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert len({m["pg_loss"] for m in metrics}) > 1, "the job must train, or equality would prove nothing"
    assert any(m["sampling/generated_groups"] > 4 for m in metrics), "dynamic sampling must draw surplus groups"
    assert metrics[-1]["lr_kl_scale"] < 1, "the KL target must move the rate"
    return metrics, prompts


@pytest.mark.parametrize("fault, resumed_from", [("generate:5", {2}), ("sync:5", {2}), ("save:4", {2}), ("train:6", {2, 4})])
def test_a_killed_run_resumes_to_the_same_record(workdir, uninterrupted, fault, resumed_from):
    out = workdir / f"killed-{fault.replace(':', '-')}"
    killed = train(workdir, out, fault=fault)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    if fault.startswith("save"):
        assert step_dir(out / "checkpoints", 4, incomplete=True).is_dir()  # the interrupted save stays incomplete

    resumed = train(workdir, out, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert any(f"continuing from '{step_dir(out / 'checkpoints', step).resolve()}'" in resumed.stdout
               for step in resumed_from), resumed.stdout
    metrics, prompts = records(out)
    assert metrics == uninterrupted[0]
    assert prompts == uninterrupted[1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["first_reward"] == uninterrupted[0][0]["reward/mean"]


# PPO with a critic: the critic's weights and AdamW state are in the checkpoint, and so is the count of RL
# steps that ends its warm-up (the actor trains from step 4, after the step-2 checkpoint and before step 4's)
PPO = ("algo.advantage=gae", "critic.actor_freeze_steps=3", "critic.lr=0.001", "algo.kl_coef=0.05",
       "algo.kl_in_reward=true")


def test_a_killed_ppo_run_resumes_to_the_same_record(workdir):
    whole = workdir / "ppo-uninterrupted"
    proc = train(workdir, whole, *PPO)
    assert proc.returncode == 0, proc.stderr
    expected = records(whole)
    assert [m["actor/frozen"] for m in expected[0]] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert len({m["critic/value_loss"] for m in expected[0]}) > 1 and "pg_loss" in expected[0][-1]

    out = workdir / "ppo-killed"
    killed = train(workdir, out, *PPO, fault="train:5")
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    resumed = train(workdir, out, *PPO, "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr
    assert f"continuing from '{step_dir(out / 'checkpoints', 2).resolve()}'" in resumed.stdout, resumed.stdout
    assert records(out) == expected


def test_resume_auto_without_a_checkpoint_starts_fresh_and_says_so(workdir, uninterrupted):
    out = workdir / "fresh"
    proc = train(workdir, out, "run.resume=auto", "run.checkpoint_every=0")
    assert proc.returncode == 0, proc.stderr
    assert "no complete checkpoint" in proc.stdout and "starting fresh" in proc.stdout
    assert records(out) == uninterrupted


def test_the_kept_checkpoints_are_the_newest_and_complete(workdir, uninterrupted):
    root = workdir / "uninterrupted" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]


def test_resume_auto_falls_back_past_a_damaged_newest_checkpoint(workdir, uninterrupted):
    out = workdir / "damaged-newest"
    shutil.copytree(workdir / "uninterrupted", out)
    shard = step_dir(out / "checkpoints", 6) / "trainer" / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])  # a disk that filled up, a copy cut short
    proc = train(workdir, out, "run.resume=auto")
    assert proc.returncode == 0, proc.stderr
    assert "skipped" in proc.stdout and "step-00000006" in proc.stdout
    assert f"continuing from '{step_dir(out / 'checkpoints', 4).resolve()}'" in proc.stdout
    assert records(out) == uninterrupted


@pytest.mark.slow
def test_kills_at_random_moments_resume_to_the_same_record(workdir, uninterrupted):
    """SIGKILL at seeded random moments (before any checkpoint, mid-step, mid-save...) and resume, until the run ends."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random kill moments from seed {seed}")  # shown with -s, and by pytest when the test fails
    rng = random.Random(seed)
    out = workdir / f"random-kills-{seed}"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(workdir), os.environ.get("PYTHONPATH")) if p))
    env.pop("GCORE_FAULT", None)
    for attempt in range(8):
        command = [sys.executable, "-m", "gcore_rl.cli", "train", str(RECIPE), "model.path=tiny", f"run.output_dir={out}",
                   *JOB, *(["run.resume=auto"] if attempt else [])]
        process = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            stdout, stderr = process.communicate(timeout=rng.uniform(3.0, 12.0) if attempt < 7 else TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()  # SIGKILL, wherever the run is
            process.communicate()
            continue
        assert process.returncode == 0, f"seed {seed}, attempt {attempt}:\n{stderr}"
        break
    assert records(out) == uninterrupted, f"seed {seed}"
