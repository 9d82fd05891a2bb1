"""PPO's critic on devices of its own (`placement.critic_devices`) on Ray: one controller.

- Moving the critic changes where it runs and nothing else: `disaggregated` with the actor and the critic
  on one training device, and with each on its own, give the same record step for step (the values reach
  the actor's GAE from the critic device; the returns are computed on both sides from the same values).
- The critic's update runs while the actor prepares and trains (read from the recorded timelines, with an
  injected 1 s in both updates), it checkpoints into `critic/` beside `trainer/`, and a run saved at step 2
  resumes to the uninterrupted record — on the same devices exactly, and with the critic resharded from
  one device to two (DCP, as the trainer's state) up to the order of float32 sums.
- Under `colocate` the critic's device also generates: the slice's trainer publishes the new weights in
  many small buckets and the critic device loads them into its engine, while the trainer loads its own
  engine as it gathers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from ray_reward_world import ray_reward_world

from gcore_rl.checkpoint.layout import CRITIC_DIR, CRITIC_STATE, TRAINER_DIR, step_dir
from gcore_rl.checkpoint.manifest import verify
from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.errors import ConfigError
from gcore_rl.runtime.driver import run_job
from gcore_rl.runtime.resume import check_compatible

pytestmark = pytest.mark.slow  # a critic apart on Ray: `make test-slow`

ray = pytest.importorskip("ray")

STEPS = 3
SUM_ORDER = 1e-5
"""The same update on another number of ranks differs only in the order of float32 sums."""
UNTIMED = ("time", "throughput/", "util/", "memory/", "work/", "phase/")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    with ray_reward_world(ray, tmp_path_factory.mktemp("ray-critic"), "digits_critic", devices=4) as root:
        yield root


def job(root: Path, out: Path, strategy: str, devices: int, *extra: str) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={root / 'tiny'}", f"run.output_dir={out}", f"run.steps={STEPS}", "run.prompts_per_step=4",
        "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false",
        "run.save_final=false", "reward.rules.0.fn=digits_critic:fraction", "runtime.kind=ray",
        "runtime.controllers=1", f"runtime.devices_per_controller={devices}", "runtime.threads_per_process=1",
        f"placement.strategy={strategy}", "algo.advantage=gae", "algo.kl_coef=0.05", "critic.lr=0.01",
        "train.mini_batches=2", *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def untimed(out: Path) -> list[dict]:
    return [{key: v for key, v in line.items() if not key.startswith(UNTIMED)} for line in metrics(out)]


def timeline(out: Path, device: int) -> list[dict]:
    return [json.loads(x) for x in (out / "timeline" / f"device-{device}.jsonl").read_text().splitlines()]


def test_the_critic_apart_trains_as_beside_the_actor_overlaps_it_and_resumes_exactly(workdir):
    beside, apart, part = workdir / "beside", workdir / "apart", workdir / "apart-part"
    run_job(job(workdir, beside, "disaggregated", 2, "placement.train_devices=1"))
    apart_job = ["placement.train_devices=2", "placement.critic_devices=1", "train.added_seconds_per_update=1.0",
                 "run.checkpoint_every=2"]
    run_job(job(workdir, apart, "disaggregated", 3, *apart_job))
    records = untimed(apart)
    assert [line["step"] for line in records] == list(range(1, STEPS + 1))
    assert all("critic/value_loss" in line and "critic/explained_variance" in line for line in records)
    assert records == untimed(beside)
    # the critic's counted work: next to the actor its value pass is among the actor's prepare passes
    for line in metrics(apart):
        assert line["work/critic/optimiser_steps"] > 0 and line["work/critic/prepare_micro_batches"] > 0
    assert all(line["work/critic/optimiser_steps"] > 0 and "work/critic/prepare_micro_batches" not in line
               for line in metrics(beside))

    # the critic's update (device 1) meets the actor's prepare + train (device 0) in every step
    actor, critic = timeline(apart, 0), timeline(apart, 1)
    assert {e["role"] for e in critic} == {"critic"} and "critic" not in {e["role"] for e in actor}
    for step in range(1, STEPS + 1):
        spans = [e for e in actor if e["what"] in ("update/prepare", "update/train") and e["step"] == step]
        start, end = min(e["start"] for e in spans), max(e["end"] for e in spans)
        update = [e for e in critic if e["what"] == "update/critic" and e["step"] == step]
        assert update and any(e["start"] < end and start < e["end"] for e in update), (step, start, end, update)

    saved = step_dir(apart / "checkpoints", 2)
    verify(saved)  # the critic's DCP metadata is listed and checked like the trainer's
    assert (saved / CRITIC_DIR / ".metadata").is_file() and (saved / CRITIC_STATE).is_file()
    assert (saved / TRAINER_DIR / ".metadata").is_file()
    # a job that puts the critic back with the actor is told so before anything starts
    with pytest.raises(ConfigError) as info:
        check_compatible(job(workdir, part, "disaggregated", 3, "placement.train_devices=2",
                             "train.added_seconds_per_update=1.0", "run.checkpoint_every=2"), saved)
    assert info.value.key == "placement.critic_devices" and "with the actor" in info.value.message
    run_job(job(workdir, part, "disaggregated", 3, *apart_job, "run.steps=2"))
    shutil.copytree(part, workdir / "reshard")
    run_job(job(workdir, part, "disaggregated", 3, *apart_job, "run.resume=auto"))
    assert untimed(part) == records

    # the same checkpoint on two critic devices (and the one actor device): DCP reshards the critic's state
    reshard = workdir / "reshard"
    run_job(job(workdir, reshard, "disaggregated", 4, "placement.train_devices=3", "placement.critic_devices=2", "train.added_seconds_per_update=1.0",
                "run.checkpoint_every=2", "run.resume=auto"))
    resumed, expected = metrics(reshard)[2], records[2]
    assert resumed["step"] == 3
    for key in ("critic/value_loss", "critic/values_mean", "critic/explained_variance", "critic/returns_mean",
                "pg_loss", "reward/mean"):
        assert resumed[key] == pytest.approx(expected[key], abs=SUM_ORDER), key


def test_under_colocate_the_critic_device_generates_with_published_weights(workdir):
    # buckets of 8 KiB: the tiny model's ~100 KiB of weights in a dozen, more than the two in flight and the
    # trainer's own stream hold, so a trainer that waited for a load queued behind its own stream would hang
    out = workdir / "colocate"
    run_job(job(workdir, out, "colocate", 2, "placement.critic_devices=1", "run.steps=2",
                "runtime.weight_bucket_mib=0.0078125", "runtime.phase_timeout_s=120"))
    assert [line["step"] for line in metrics(out)] == [1, 2]
    actor, critic = timeline(out, 0), timeline(out, 1)
    assert {e["role"] for e in actor} >= {"rollout", "actor"} and "critic" not in {e["role"] for e in actor}
    assert {e["role"] for e in critic} >= {"rollout", "critic"} and "actor" not in {e["role"] for e in critic}
    # the critic device loads the published buckets of update 1 before step 2; the trainer loads as it gathers
    assert any(e["what"] == "rollout/load_weights" and e["step"] == 1 for e in critic)
    assert any(e["what"] == "update/sync" and e["step"] == 1 for e in actor)
    # the engines generate with the same weights: trainer and engine log-probs agree on both devices' samples
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in metrics(out))
