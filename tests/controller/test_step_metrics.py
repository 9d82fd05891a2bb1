"""A step's metrics are merged once, in a fixed order; every seed of a step comes from one function."""

from __future__ import annotations

import torch

from gcore_rl.controller.seeds import device_seed, evaluation_seed, step_seeds
from gcore_rl.controller.step_metrics import StepMetrics, device_utilisation
from gcore_rl.distributed import DistInfo


def test_seeds_keep_the_formulas_runs_were_seeded_with():
    seeds = step_seeds(run_seed=7, step=3, controller=2)
    assert seeds.rollout == 7 * 100_003 + 3 * 97 + 2
    assert [seeds.wave(w) for w in (0, 1)] == [seeds.rollout * 31, seeds.rollout * 31 + 1]
    assert device_seed(seeds.wave(1), 2) == seeds.rollout * 31 + 1 + 2 * 7919
    assert evaluation_seed(7) == 7  # greedy evaluation: the run seed, the same at every step
    assert len({step_seeds(0, s, c).rollout for s in range(1, 50) for c in range(4)}) == 49 * 4


def test_step_metrics_merge_every_group_once_and_derive_throughput():
    metrics = StepMetrics(rollout={"reward/sum": 3.0, "reward/sum_sq": 5.0, "reward/count": 4.0, "reward/mean": 0.0},
                          batch={"rollout/generated_tokens": 40.0}, train={"pg_loss": 0.5},
                          phases={"time/rollout": 1.0}, placement={"placement/rollout_devices": 2.0},
                          data={"data/prompts_dropped": 0.0}, devices={"util/idle_s": 0.25}, step_seconds=2.0)
    local = metrics.local()
    assert list(local)[:9] == ["reward/sum", "reward/sum_sq", "reward/count", "reward/mean", "rollout/generated_tokens",
                               "pg_loss", "time/rollout", "placement/rollout_devices", "data/prompts_dropped"]
    assert local["time/step"] == 2.0 and local["throughput/tokens_per_s"] == 20.0 and local["util/idle_s"] == 0.25
    assert local["memory/controller_peak_rss_mib_max"] > 0
    reduced = metrics.reduce(DistInfo(rank=0, world_size=1, device=torch.device("cpu")))
    assert reduced["reward/mean"] == 0.75 and reduced["reward/std"] == (5.0 / 4 - 0.75**2) ** 0.5
    assert "reward/sum" not in reduced  # partial sums pooled away


def test_a_controllers_wait_is_taken_out_of_its_devices_idle_time():
    merged = device_utilisation({"util/idle_s": 1.0, "util/actor/busy_s": 2.0},
                                {"util/wait_s": 0.4, "util/rewards/busy_s": 0.3})
    assert merged == {"util/idle_s": 0.6, "util/actor/busy_s": 2.0, "util/wait_s": 0.4, "util/rewards/busy_s": 0.3}
    assert device_utilisation({"util/idle_s": 0.1}, {"util/wait_s": 0.5})["util/idle_s"] == 0.0
