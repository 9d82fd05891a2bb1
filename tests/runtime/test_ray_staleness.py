"""Bounded staleness k (`placement.max_staleness`) on Ray: `disaggregated`, one controller, one trainer and
one rollout device.

The schedule depends on step numbers only (controller/loop.py), so the counted versions are exact: step s
trains at trainer version s-1 on samples made with the weights of version max(0, s-1-k), and the queue of
rollouts made ahead holds min(k, steps - s) at the end of step s. With k = 1 that is one-step-off as
before. A run saved at step 2 with k rollouts queued resumes to the uninterrupted record.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_reward_world import ray_reward_world

from gcore_rl.checkpoint.layout import controller_file, step_dir
from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.runtime.driver import run_job

pytestmark = pytest.mark.slow  # bounded staleness on Ray (the harness covers the schedule): `make test-slow`

ray = pytest.importorskip("ray")

STEPS = 5
UNTIMED = ("time", "throughput/", "util/", "memory/")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    with ray_reward_world(ray, tmp_path_factory.mktemp("ray-staleness"), "digits_staleness", devices=2) as root:
        yield root


def job(root: Path, out: Path, k: int, *extra: str) -> JobConfig:
    return load_config(JobConfig, None, [
        f"model.path={root / 'tiny'}", f"run.output_dir={out}", f"run.steps={STEPS}", "run.prompts_per_step=4",
        "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false",
        "run.save_final=false", "reward.rules.0.fn=digits_staleness:fraction", "runtime.kind=ray",
        "runtime.controllers=1", "runtime.devices_per_controller=2", "runtime.threads_per_process=1",
        "placement.strategy=disaggregated", f"placement.max_staleness={k}", *extra])


def metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_no_trained_sample_lags_more_than_k_updates_and_the_bound_is_reached(workdir, k):
    run_job(job(workdir, workdir / f"k{k}", k))
    lines = metrics(workdir / f"k{k}")
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    expected = [float(min(step - 1, k)) for step in range(1, STEPS + 1)]  # trainer version - sampling version
    assert [line["rollout/staleness_max"] for line in lines] == expected
    assert [line["rollout/staleness_mean"] for line in lines] == expected  # a step's samples share one version
    assert max(expected) == k
    assert [line["placement/rollouts_ahead"] for line in lines] == [float(min(k, STEPS - s)) for s in range(1, STEPS + 1)]
    # the behaviour-policy correction keeps stale rows' ratios at the engine's log-probs; fresh rows match
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in lines)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2, pytest.param(3, marks=pytest.mark.slow)])
def test_dynamic_samplings_surplus_is_held_to_the_bound_too(workdir, k):
    """Surplus valid groups buffered for a later step were made for a rollout already k updates behind: one
    step later they would be k + 1 behind, so they are dropped (their prompts generated again) instead."""
    out = workdir / f"dynamic-k{k}"
    run_job(job(workdir, out, k, *DYNAMIC))
    lines = metrics(out)
    assert all(line["rollout/staleness_max"] <= k for line in lines)
    assert max(line["rollout/staleness_max"] for line in lines) == k
    assert sum(line["sampling/stale_dropped"] for line in lines) > 0  # there was surplus, and it was too old


DYNAMIC = ("dynamic_sampling.enabled=true", "dynamic_sampling.oversampling=1.5")
"""Dynamic sampling with a surplus most steps (1.5 x the missing groups drawn, most groups valid)."""


def test_a_checkpoint_keeps_the_k_queued_rollouts_and_the_surplus_and_resumes_exactly(workdir):
    k = 2
    whole, part = workdir / "resume-whole", workdir / "resume-part"
    run_job(job(workdir, whole, k, "run.checkpoint_every=2", *DYNAMIC))
    run_job(job(workdir, part, k, "run.checkpoint_every=2", "run.steps=2", *DYNAMIC))
    saved = json.loads((step_dir(part / "checkpoints", 2) / controller_file(0)).read_text())
    assert len(saved["ahead"]) == k  # the rollouts of steps 3 and 4, made during step 2's update and before
    assert saved["waves"]["buffer"]  # surplus groups waiting for a later step
    run_job(job(workdir, part, k, "run.checkpoint_every=2", "run.resume=auto", *DYNAMIC))
    untimed = [[{key: v for key, v in line.items() if not key.startswith(UNTIMED)} for line in metrics(out)]
               for out in (whole, part)]
    assert untimed[0] == untimed[1]
    assert (part / "prompts" / "controller-0.jsonl").read_text() == (whole / "prompts" / "controller-0.jsonl").read_text()
