"""A Ray job saved on 2 trainer devices resumes on 1 (and, in the slow target, 4): DCP reshards the trainer
state, and the first resumed step trains on what the uninterrupted job trained on.

`disaggregated` placement, one controller: the trainer devices change (`placement.train_devices`)
while the single rollout device stays, so generation and its seeds are the same, and the rollout
of step 3, generated before the save of step 2, is restored from the checkpoint. So the first
resumed step's loss must equal the uninterrupted job's up to the order of the sums over trainer
ranks (1e-5), and every step draws the same prompts.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_reward_world import ray_reward_world

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.runtime.driver import run_job

pytestmark = pytest.mark.slow  # resharding trainers on Ray: `make test-slow`

ray = pytest.importorskip("ray")

LOSS_TOLERANCE = 1e-5
"""The same update on another number of trainer ranks differs only in the order of float32 sums."""


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    with ray_reward_world(ray, tmp_path_factory.mktemp("ray-reshard"), "digits_reshard", devices=5) as root:
        yield root


def job(root: Path, out: Path, trainers: int, steps: int, *extra: str) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={root / 'tiny'}", f"run.output_dir={out}", f"run.steps={steps}", "run.checkpoint_every=2",
        "run.prompts_per_step=4", "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=0",
        "run.progress=false", "run.save_final=false", "reward.rules.0.fn=digits_reshard:fraction",
        "runtime.kind=ray", "runtime.controllers=1", f"runtime.devices_per_controller={trainers + 1}",
        "runtime.threads_per_process=1", "placement.strategy=disaggregated", f"placement.train_devices={trainers}",
        *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def prompts(out: Path) -> list[str]:
    return (out / "prompts" / "controller-0.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    out = workdir / "uninterrupted"
    run_job(job(workdir, out, trainers=2, steps=3))
    return metrics(out), prompts(out)


@pytest.mark.parametrize("trainers", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_a_two_trainer_checkpoint_resumes_on_another_number_of_trainers(workdir, uninterrupted, trainers):
    out = workdir / f"to-{trainers}"
    run_job(job(workdir, out, trainers=2, steps=2))
    summary = run_job(job(workdir, out, trainers, 3, "run.resume=auto"))
    assert summary.steps == 3
    expected, resumed = uninterrupted[0][2], metrics(out)[2]
    assert resumed["step"] == 3 and resumed["rollout/staleness_max"] == 1.0  # the restored one-step-off rollout
    for key in ("pg_loss", "approx_kl", "entropy", "reward/mean", "response_length/mean"):
        assert resumed[key] == pytest.approx(expected[key], abs=LOSS_TOLERANCE), key
    assert prompts(out) == uninterrupted[1]
