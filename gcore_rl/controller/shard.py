"""A controller's data: its shard of the prompt rows, their order, its dynamic-sampling state and its held-out
rows (a language job's loaded and fitted to the policy's context by `ControllerShard.load`)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

from gcore_rl.algos.dynamic_sampling import WaveSampler
from gcore_rl.config import JobConfig, prompt_room
from gcore_rl.controller.program import ControllerContext
from gcore_rl.data.lengths import load_fitted_shard
from gcore_rl.data.sampler import ShardedPromptSampler
from gcore_rl.distributed import DistInfo
from gcore_rl.rollout.functions import prompt_tools


@dataclass
class ControllerShard:
    """This controller's data: its prompt rows (every prompt checked against the policy's context
    before the first step), their order, its dynamic-sampling state and its held-out rows."""

    rows: list[dict]
    row_ids: list[int]
    eval_rows: list[dict]
    length_stats: dict[str, float]
    sampler: ShardedPromptSampler
    waves: WaveSampler

    @classmethod
    def load(cls, cfg: JobConfig, ctx: ControllerContext, info: DistInfo) -> ControllerShard:
        fitted = load_fitted_shard(cfg.data, ctx.prompts, prompt_room(cfg), info.rank, info.world_size,
                                   tools=prompt_tools(cfg.rollout))
        sampler = ShardedPromptSampler(len(fitted.rows), seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                       shard_index=info.rank)
        waves = WaveSampler(cfg.dynamic_sampling,
                            cfg.dynamic_sampling.resolve_target(cfg.run.prompts_per_step // info.world_size),
                            max_age=surplus_age_bound(cfg, ctx.plan.traits.overlaps_steps))
        return cls(rows=fitted.rows, row_ids=fitted.row_ids, eval_rows=fitted.eval_rows, length_stats=fitted.metrics,
                   sampler=sampler, waves=waves)

    @functools.cached_property
    def local(self) -> dict[int, int]:
        """The position in `rows` of each global row number the shard holds."""
        return {row: index for index, row in enumerate(self.row_ids)}

    def draw(self, count: int) -> list[tuple[int, dict]]:
        """The next `count` prompt rows of the shard, each with its global row number."""
        return [(self.row_ids[i], self.rows[i]) for i in self.sampler.next_indices(count)]

    def rows_of(self, row_ids: Sequence[int]) -> list[tuple[int, dict]]:
        """The shard's rows of the global row numbers `row_ids` (rows of surplus groups to generate again)."""
        return [(row, self.rows[self.local[row]]) for row in row_ids]


def surplus_age_bound(cfg: JobConfig, overlaps_steps: bool) -> int | None:
    """Most trainer updates a buffered surplus group may lag the trainer when it is trained (None: dynamic
    sampling is off, nothing is buffered): the bounded staleness k of a plan that rolls out ahead, which
    holds for every trained sample, else `dynamic_sampling.max_surplus_age`."""
    if not cfg.dynamic_sampling.enabled:
        return None
    return cfg.placement.max_staleness if overlaps_steps else cfg.dynamic_sampling.max_surplus_age
