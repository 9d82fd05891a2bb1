"""Kill a Ray job at a named phase of a named step (GCORE_FAULT: the device worker or controller actor
that reaches it dies by SIGKILL) and resume it: the per-step record equals that of the uninterrupted
job, for colocate, partial and disaggregated (one-step-off, whose next rollout is in flight at every
save) placements on one controller with two devices.

Saves every 2 steps; the save of step N completes at the end of step N + 1, so a kill in step 4
resumes from step 2 (or, when the kill comes before controller 0's background thread renamed it,
from nothing: a fresh start). Either way the record must be the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_reward_world import ray_reward_world

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.errors import GcoreError
from gcore_rl.faults import ENV as FAULT_ENV
from gcore_rl.runtime.driver import run_job

pytestmark = pytest.mark.slow  # killed Ray jobs resumed (the harness covers every strategy's resume): `make test-slow`

ray = pytest.importorskip("ray")

STEPS = 5
UNTIMED = ("time", "throughput/", "util/", "memory/")
FAULTS = {
    "colocate": ["generate:4", "train:4", "save:4"],
    "partial": ["generate:4", "sync:4", "save:4"],
    "disaggregated": ["generate:4", "train:4", "sync:4"],
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """A tiny model, and a reward module the controller actors import (on PYTHONPATH before Ray starts)."""
    with ray_reward_world(ray, tmp_path_factory.mktemp("ray-resume"), "digits_reward", devices=2) as root:
        yield root


def job(root: Path, out: Path, strategy: str, *extra: str) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={root / 'tiny'}", f"run.output_dir={out}", f"run.steps={STEPS}", "run.checkpoint_every=2",
        "run.prompts_per_step=4", "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=0",
        "run.progress=false", "run.save_final=false", "reward.rules.0.fn=digits_reward:fraction",
        "runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2",
        "runtime.threads_per_process=1", f"placement.strategy={strategy}", *extra])


def records(out: Path) -> tuple[list[dict], list[str]]:
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, (out / "prompts" / "controller-0.jsonl").read_text().splitlines()


@pytest.fixture(scope="module")
def uninterrupted(workdir):
    """Each strategy's record without a fault."""
    out = {}
    for strategy in FAULTS:
        run_job(job(workdir, workdir / f"{strategy}-uninterrupted", strategy))
        out[strategy] = records(workdir / f"{strategy}-uninterrupted")
        assert len(out[strategy][0]) == STEPS
        assert len({m["pg_loss"] for m in out[strategy][0]}) > 1, "the job must train"
    return out


QUICK = {("colocate", "train:4"), ("partial", "generate:4"), ("disaggregated", "sync:4")}
"""One fault per strategy in the default suite; the others run in the `slow` target."""


@pytest.mark.parametrize("strategy, fault", [
    pytest.param(s, f, marks=() if (s, f) in QUICK else pytest.mark.slow) for s, faults in FAULTS.items() for f in faults])
def test_a_killed_ray_job_resumes_to_the_same_record(workdir, uninterrupted, monkeypatch, strategy, fault):
    out = workdir / f"{strategy}-{fault.replace(':', '-')}"
    monkeypatch.setenv(FAULT_ENV, fault)
    with pytest.raises(GcoreError, match="died|failed"):
        run_job(job(workdir, out, strategy))
    assert len(records(out)[0]) == 3  # steps 1-3 were recorded, step 4 was not
    monkeypatch.delenv(FAULT_ENV)
    summary = run_job(job(workdir, out, strategy, "run.resume=auto"))
    assert summary.steps == STEPS
    assert records(out) == uninterrupted[strategy]


@pytest.mark.parametrize("strategy, fault, in_place", [
    ("colocate", "train:4", False),  # a trainer actor
    ("colocate", "save:4", False),  # the controller actor, while the trainers write a checkpoint
    ("disaggregated", "generate:4", True),  # the rollout actor, which holds no trainer shard
])
def test_a_killed_ray_job_heals_itself_to_the_same_record(workdir, uninterrupted, monkeypatch, strategy, fault,
                                                          in_place):
    """With `run.max_restarts=1` a killed actor never hangs the job: a rollout device is revived in place and
    the step goes on; any other death restarts the job from its newest checkpoint. Either way the record is
    the uninterrupted one, and the time from the kill to training (or generating) again is recorded."""
    out = workdir / f"{strategy}-{fault.replace(':', '-')}-healed"
    monkeypatch.setenv(FAULT_ENV, fault)
    summary = run_job(job(workdir, out, strategy, "run.max_restarts=1"))
    assert summary.steps == STEPS and records(out) == uninterrupted[strategy]
    if in_place:
        assert not (out / "restarts.jsonl").exists()
        [revived] = [json.loads(line) for line in (out / "device_restarts.jsonl").read_text().splitlines()]
        assert revived["step"] == 4 and 0 <= revived["revive_s"] <= revived["kill_to_back_s"]
    else:
        [restart] = [json.loads(line) for line in (out / "restarts.jsonl").read_text().splitlines()]
        assert "died" in restart["cause"]
        assert restart["kill_at"] <= restart["time"] <= restart["training_again_at"]
        assert 0 <= restart["failure_to_training_s"] <= restart["kill_to_training_s"]
