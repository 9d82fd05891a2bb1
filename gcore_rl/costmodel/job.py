"""A job as the cost model sees it: concrete hardware, model shapes, cost constants, the workload and the
device counts of each slice (`Job`). The simulator resolves one from a scenario (`gcore_rl.sim.scenario.resolve_job`);
dynamic placement's forecast builds a one-slice job from the run's models (`gcore_rl.costmodel.replay.slice_job`)."""

from __future__ import annotations

from dataclasses import dataclass

from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.models import ModelSpec
from gcore_rl.costmodel.work import Workload
from gcore_rl.placement.rebalance import RebalanceConfig


@dataclass(frozen=True)
class Job:
    """A scenario resolved into concrete hardware, model shapes and per-slice device counts."""

    hardware: Hardware
    policy: ModelSpec
    judge: ModelSpec | None
    reference: bool
    policy_tp: int
    judge_tp: int
    costs: CostConstants
    workload: Workload
    gpus: int
    controllers: int
    max_num_seqs: int
    memory_utilization: float
    offload_trainer: bool
    rollout_devices: int  # partial / dynamic start, per slice
    train_devices: int  # disaggregated, per slice
    generation_rollout_devices: int  # disaggregated, per slice
    rebalance: RebalanceConfig
    rebalance_model: str = "replay"  # dynamic: `PlacementSettings.dynamic_model`
    wave_resplit: bool = False  # dynamic: `PlacementSettings.wave_resplit`
    max_staleness: float = 1.0  # streaming: `PlacementSettings.max_staleness`
    partial_rollout: bool = False  # streaming
    train_chunks: int = 1  # streaming
    recompute_logprobs: bool = True  # streaming

    @property
    def slice_devices(self) -> int:
        return self.gpus // self.controllers
