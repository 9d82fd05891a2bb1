"""Where a controller's run stands between steps, what its checkpoint keeps of it, and how a run resumes:
`RunProgress`, `capture_state`, `resume_run` (on the same or another number of controllers)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from torch import Tensor

from gcore_rl.checkpoint.layout import controller_file
from gcore_rl.controller.checkpointing import ControllerState, decode_rollout, encode_rollout
from gcore_rl.controller.program import ControllerContext, StepRollout
from gcore_rl.controller.shard import ControllerShard
from gcore_rl.distributed import DistInfo, all_reduce_mean
from gcore_rl.errors import CheckpointError, ConfigError
from gcore_rl.placement.rebalance import RolloutLoad


@dataclass
class RunProgress:
    """Where a controller's run stands between steps (what a checkpoint keeps besides the data order):
    the last finished step, the rollouts a resumed run finds made for the next ones (`ahead[i]` is step
    `step + 1 + i`'s; at most `placement.max_staleness`; handed to the run's `Schedule`, which holds the queue
    from then on and gives it back as `queued()` to each save), the rebalancer's history, and the figures
    the summary reports."""

    step: int = 0
    ahead: list[StepRollout] = field(default_factory=list)
    loads: list[RolloutLoad] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    eval_before: dict[str, float] = field(default_factory=dict)  # the held-out evaluation before the first step
    eval_after: dict[str, float] = field(default_factory=dict)  # and after the last update evaluated


def capture_state(info: DistInfo, ctx: ControllerContext, shard: ControllerShard, run: RunProgress,
                  ahead: list[StepRollout]) -> ControllerState:
    """This controller's checkpoint state after `run.step`, with `ahead`, the rollouts made for the next
    steps (the schedule's queue)."""
    tensors: dict[str, Tensor] = {}
    encode = functools.partial(ctx.samples.encode_payload, tensors=tensors)
    return ControllerState(step=run.step, controllers=info.world_size, sampler=shard.sampler.state_dict(),
                           epoch=shard.sampler.epoch, drawn_rows=[shard.row_ids[i] for i in shard.sampler.drawn_in_epoch()],
                           waves=shard.waves.state_dict(encode), loads=[load.as_dict() for load in run.loads],
                           rollout_devices=ctx.plan.rollout_devices, plan_version=ctx.plan.version,
                           ahead=[encode_rollout(rollout, encode) for rollout in ahead],
                           rewards=list(run.rewards), eval_before=dict(run.eval_before),
                           eval_after=dict(run.eval_after), tensors=tensors)


def resume_run(cfg: Any, info: DistInfo, ctx: ControllerContext, shard: ControllerShard,
               folder: Path) -> RunProgress:
    """Restore the trainers, the engines' weights, the plan and this controller's data state from the
    checkpoint `folder`, and return where the run stands.

    On the same number of controllers each takes up its own saved state. On another number, the
    sampler continues the epoch in progress with the rows no controller had drawn in it (rows of an
    epoch that a controller had not finished when another had moved on are not revisited), every
    controller ending that epoch after as many rows as the controller with the fewest left (the
    others' extra rows wait for the next epoch: no row is drawn twice in an epoch; going down to
    one controller, every row exactly once), and the rollouts that were in flight or buffered are
    dropped, their rows returned to the epoch.
    """
    saved = [ControllerState.read(folder / controller_file(k)) for k in range(_saved_controllers(folder))]
    mine = saved[info.rank] if len(saved) == info.world_size else None
    ctx.workers.load_checkpoint(str(folder))
    first = saved[0]
    if ctx.plan.traits.rebalances:  # the split and plan version the rebalancer had reached
        ctx.workers.apply_plan(replace(ctx.plan.with_rollout_devices(first.rollout_devices), version=first.plan_version))
    ctx.workers.sync_weights(first.step)
    if mine is not None:
        shard.sampler.load_state_dict(mine.sampler)
        decode = functools.partial(ctx.samples.decode_payload, tensors=mine.tensors, shard=shard, ctx=ctx)
        shard.waves.load_state_dict(mine.waves, decode)
        ahead = [decode_rollout(entry, decode) for entry in mine.rollouts_ahead()]
        if len(ahead) > cfg.placement.max_staleness:
            raise ConfigError("placement.max_staleness", f"the checkpoint '{folder}' holds {len(ahead)} rollouts made "
                              f"ahead, more than {cfg.placement.max_staleness} updates of staleness allow; resume with "
                              f"placement.max_staleness={len(ahead)} or more")
    else:
        epoch = max(state.epoch for state in saved)
        in_flight = {row for state in saved for row in _rows_in_flight(state)}
        drawn = {row for state in saved if state.epoch == epoch for row in state.drawn_rows} - in_flight
        shard.sampler.continue_epoch(epoch, [shard.local[row] for row in drawn if row in shard.local])
        # the shards of the new layout may hold different numbers of rows the epoch has not drawn: all
        # end the epoch with the smallest, so none draws a row twice (the others' extra rows come next epoch)
        fewest = -all_reduce_mean({"remaining_max": -float(shard.sampler.remaining_in_epoch)}, info.device)["remaining_max"]
        shard.sampler.end_epoch_after(int(fewest))
        shard.waves.load_state_dict(first.waves)  # the EMA only
        ahead = []
    return RunProgress(step=first.step, ahead=ahead, loads=first.rollout_loads(), rewards=list(first.rewards),
                       eval_before=first.eval_before, eval_after=first.eval_after)


def _saved_controllers(folder: Path) -> int:
    """How many controllers wrote the checkpoint (its controller files)."""
    count = len(list(folder.glob(controller_file(0).replace("0", "*"))))
    if count == 0:
        raise CheckpointError(f"checkpoint '{folder}' holds no {controller_file(0)}; it is not a complete checkpoint "
                              "of a training run")
    return count


def _rows_in_flight(state: ControllerState) -> list[int]:
    """Rows of a saved controller whose rollouts were in flight or buffered (a reshard drops them)."""
    rows = [group["payload"]["row_id"] for group in state.waves.get("buffer", []) if "payload" in group]
    for rollout in state.rollouts_ahead():
        rows.extend(rollout["row_ids"])
    return rows
