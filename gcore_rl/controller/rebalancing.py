"""Dynamic placement between a rollout phase and its update: every controller measures, all-reduces and
takes the same decision (`rebalance_split`), recorded as the step's `placement/*` metrics."""

from __future__ import annotations

from collections.abc import Sequence

from gcore_rl.config import JobConfig
from gcore_rl.controller.forecast import RolloutForecaster
from gcore_rl.controller.program import ControllerContext
from gcore_rl.distributed import DistInfo, all_reduce_mean
from gcore_rl.placement.plan import reward_roles
from gcore_rl.placement.rebalance import Decision, RolloutLoad, rebalance
from gcore_rl.records import WaveWork
from gcore_rl.telemetry.metrics import PhaseTimer


def rebalance_split(cfg: JobConfig, ctx: ControllerContext, loads: list[RolloutLoad], info: DistInfo,
                    timer: PhaseTimer, work: Sequence[WaveWork] = (),
                    forecaster: RolloutForecaster | None = None) -> dict[str, float]:
    """Dynamic placement, between a rollout phase and its update: choose the next rollout / reward split.

    Each controller measures its slice's load and the work behind it, one all-reduce averages both
    over the controllers (float64, so every controller holds the same numbers), and each runs the
    same pure `rebalance` on the same history, so all slices move alike, to the same next plan
    version, without a central process. The new plan takes effect at this step's sync: only the
    devices that generate next load the policy's weights. Returns the step's placement metrics
    (`placement_metrics`).
    """
    own = ctx.workers.rollout_load(timer.timings().get("time/rollout", 0.0))
    counted = {f"placement/{name}": value for name, value in vars(ctx.workers.rollout_work()).items()}
    scalars = {name: value for name, value in vars(own).items() if name != "forecast"}  # the runtime forecasts nothing
    rounds = ctx.workers.engine_rounds() if forecaster is not None and forecaster.fits_engines else None
    forecasts = forecaster.forecast(work, own, rounds) if forecaster is not None else {}
    reduced = all_reduce_mean({**scalars, **counted, **forecasts}, info.device)
    measured = {name: reduced[name] for name in scalars}
    measured["rollout_devices"] = round(measured["rollout_devices"])  # the same on every controller
    load = RolloutLoad(**measured, forecast=forecaster.vector(reduced) if forecasts else ())
    loads.append(load)
    current = ctx.plan.rollout_devices
    min_devices = cfg.placement.min_devices
    min_reward = max([min_devices.get(role, 1) for role in reward_roles(ctx.plan.roles)], default=1)
    decision = rebalance(loads, current, len(ctx.plan.slices[0]), cfg.placement.rebalance,
                         min_rollout=min_devices.get("rollout", 1), min_reward=min_reward)
    if decision.rollout_devices != current:
        ctx.workers.apply_plan(ctx.plan.with_rollout_devices(decision.rollout_devices))
    return {**placement_metrics(current, decision, load, ctx.plan.version), **{k: reduced[k] for k in counted},
            **{f"placement/{k}": v for k, v in reduced.items() if k in forecasts}}


def placement_metrics(current: int, decision: Decision, load: RolloutLoad, plan_version: int) -> dict[str, float]:
    """One step's `placement/*` metrics: the split used (`rollout_devices`) and the next one, the plan
    version after the decision, the rollout phase predicted at both splits (`predicted_rollout_s`,
    `next_predicted_rollout_s`: `Decision.current_s` / `predicted_s`) and measured, the step's load
    the rebalancer was fed (`generate_device_s`, `generate_fixed_s`, `score_device_s`,
    `score_fixed_s`, `swap_s`), and the move's cost: `moved_devices` (|next - current|) and
    `move_swap_s` (the step's `swap_s` when the split moves, else 0)."""
    moved = abs(decision.rollout_devices - current)
    return {"placement/rollout_devices": float(current), "placement/next_rollout_devices": float(decision.rollout_devices),
            "placement/next_plan_version": float(plan_version),
            "placement/predicted_rollout_s": decision.current_s, "placement/next_predicted_rollout_s": decision.predicted_s,
            "placement/measured_rollout_s": load.phase_s,
            "placement/generate_device_s": load.generate_s, "placement/generate_fixed_s": load.generate_fixed_s,
            "placement/score_device_s": load.score_s, "placement/score_fixed_s": load.score_fixed_s,
            "placement/swap_s": load.swap_s,
            "placement/moved_devices": float(moved), "placement/move_swap_s": load.swap_s if moved else 0.0}
