"""`rebalance_split` on in-process fake device workers: the split it chooses and the `placement/*`
metrics it reports (the load it fed the rebalancer, the predictions, the move's cost, the tokens)."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.config import JobConfig
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.program import ControllerContext
from gcore_rl.controller.rebalancing import rebalance_split
from gcore_rl.controller.slice import SliceClient
from gcore_rl.distributed import DistInfo
from gcore_rl.placement.plan import plan, worker_specs
from gcore_rl.placement.rebalance import DeviceLoad, RolloutLoad
from gcore_rl.records import RolloutWork

ONE_CONTROLLER = DistInfo(rank=0, world_size=1, device=torch.device("cpu"))


class FakeDevice:
    """Reports the load and work of whichever side of the rollout phase the slice's plan gives it."""

    def __init__(self, device: int, client_plan, judge_s: float):
        self.device, self.client_plan, self.judge_s = device, client_plan, judge_s

    def _judges(self) -> bool:
        return self.device in self.client_plan().devices_of("rollout", "judge")

    def device_load(self) -> DeviceLoad:
        if self._judges():
            return DeviceLoad(score_s=self.judge_s, score_fixed_s=0.125, swap_s=0.25)
        return DeviceLoad(generate_s=0.25, generate_fixed_s=0.125, swap_s=0.0625)

    def rollout_work(self) -> RolloutWork:
        if self._judges():
            return RolloutWork(judge_tokens=768.0, judge_prefill_tokens=600.0, judged_samples=12.0)
        return RolloutWork(policy_tokens=36.0, policy_prefill_tokens=30.0)


class PhaseSeconds:
    """Stands in for the controller's `PhaseTimer` after a rollout phase of `rollout_s` seconds."""

    def __init__(self, rollout_s: float):
        self.rollout_s = rollout_s

    def timings(self) -> dict[str, float]:
        return {"time/rollout": self.rollout_s}


def _dynamic_slice(judge_s: float) -> tuple[JobConfig, ControllerContext]:
    """One controller with a 3-device dynamic slice that starts with 2 rollout devices and 1 judge."""
    cfg = JobConfig()
    cfg.placement.strategy = "dynamic"
    job_plan = plan("dynamic", 3, ["rollout", "judge", "actor"], rollout_devices=2)
    specs = worker_specs(job_plan)
    client: SliceClient | None = None
    devices = [FakeDevice(spec.device, lambda: client.plan, judge_s) for spec in specs]
    client = SliceClient([LocalHandle(d) for d in devices], specs, job_plan)
    return cfg, ControllerContext(workers=client, rewards=None, tokenizer=None)


def test_a_starved_judge_gets_a_device_and_the_metrics_say_what_the_move_cost():
    cfg, ctx = _dynamic_slice(judge_s=2.0)
    loads: list[RolloutLoad] = []
    metrics = rebalance_split(cfg, ctx, loads, ONE_CONTROLLER, PhaseSeconds(2.5))
    # the load fed to the rebalancer: busy minus fixed seconds per side, fixed parts of the slowest device
    assert loads == [RolloutLoad(generate_s=0.25, score_s=1.875, swap_s=0.25, generate_fixed_s=0.125,
                                 score_fixed_s=0.125, generate_busy_s=0.5, score_busy_s=2.0, phase_s=2.5,
                                 rollout_devices=2)]
    assert metrics["placement/generate_device_s"] == 0.25 and metrics["placement/generate_fixed_s"] == 0.125
    assert metrics["placement/score_device_s"] == 1.875 and metrics["placement/score_fixed_s"] == 0.125
    assert metrics["placement/swap_s"] == 0.25  # the slowest handover of any device of the slice
    # T(2) = max(0.125 + 0.25/2, 0.125 + 1.875) = 2.0, T(1) = max(0.125 + 0.25, 0.125 + 1.875/2) = 1.0625, both
    # × the measured / predicted ratio of split 2 (2.5 / 2.0)
    assert metrics["placement/measured_rollout_s"] == 2.5
    assert metrics["placement/predicted_rollout_s"] == 2.5
    assert metrics["placement/next_predicted_rollout_s"] == 1.0625 * 1.25
    assert (metrics["placement/rollout_devices"], metrics["placement/next_rollout_devices"]) == (2.0, 1.0)
    assert ctx.plan.rollout_devices == 1 and metrics["placement/next_plan_version"] == ctx.plan.version == 1
    assert metrics["placement/moved_devices"] == 1.0 and metrics["placement/move_swap_s"] == 0.25
    # the work behind the load, summed over the slice: 2 rollout devices, 1 judge
    assert metrics["placement/policy_tokens"] == 72.0 and metrics["placement/policy_prefill_tokens"] == 60.0
    assert metrics["placement/judge_tokens"] == 768.0 and metrics["placement/judge_prefill_tokens"] == 600.0
    assert metrics["placement/judged_samples"] == 12.0


def test_a_split_that_stays_pays_no_move():
    cfg, ctx = _dynamic_slice(judge_s=0.25)  # the judge keeps up: T(2) = 0.25, T(1) = 0.375
    metrics = rebalance_split(cfg, ctx, [], ONE_CONTROLLER, PhaseSeconds(0.3))
    assert metrics["placement/next_rollout_devices"] == metrics["placement/rollout_devices"] == 2.0
    assert metrics["placement/moved_devices"] == 0.0 and metrics["placement/move_swap_s"] == 0.0
    assert metrics["placement/next_plan_version"] == 0.0
    assert metrics["placement/predicted_rollout_s"] == metrics["placement/next_predicted_rollout_s"] == pytest.approx(0.3)
    assert metrics["placement/swap_s"] == 0.25  # measured all the same


def test_rollout_work_adds_up_field_by_field():
    parts = [RolloutWork(policy_tokens=1.0, judge_tokens=2.0), RolloutWork(judge_tokens=3.0, judged_samples=4.0)]
    assert RolloutWork.total(parts) == RolloutWork(policy_tokens=1.0, judge_tokens=5.0, judged_samples=4.0)
    assert RolloutWork.total([]) == RolloutWork()
