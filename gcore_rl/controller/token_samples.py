"""The samples of a language or vision-language policy, as the shared step loop sees them (`SampleKind`).

A sample is a `Completion` (token ids, log-probs, loss mask): a wave generates `sampling.n` of each prompt row
and rewards them (`program.wave_rewards`), the update lays them out as a `TokenBatch` (`program.start_update`),
the held-out evaluation is greedy accuracy on the shard's held-out rows, and a checkpoint keeps a sample's
token ids (its prompt's images come back from the row).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import Tensor

from gcore_rl.config import JobConfig, frozen_model_paths
from gcore_rl.controller.checkpointing import decode_payload, encode_payload
from gcore_rl.controller.forecast import RolloutForecaster
from gcore_rl.controller.program import (
    ControllerContext,
    GroupPayload,
    StepRollout,
    greedy_accuracy,
    start_update,
    wave_rewards,
)
from gcore_rl.controller.seeds import evaluation_seed
from gcore_rl.controller.shard import ControllerShard
from gcore_rl.distributed import DistInfo, all_reduce_mean


@dataclass
class RunSummary:
    """What a finished language run reports back to the CLI (``summary.json``)."""

    output_dir: str
    steps: int
    wall_seconds: float
    first_reward: float
    last_reward: float
    eval_accuracy_before: float | None
    eval_accuracy_after: float | None


class TokenSamples:
    """A language (or vision-language) policy's samples (see the module docstring)."""

    log_samples = True
    wave = staticmethod(wave_rewards)

    def load_shard(self, cfg: JobConfig, ctx: ControllerContext, info: DistInfo) -> ControllerShard:
        return ControllerShard.load(cfg, ctx, info)

    def start_update(self, rollout: StepRollout, ctx: ControllerContext, cfg: JobConfig,
                     trainer_version: int) -> tuple[list, dict[str, float]]:
        return start_update(rollout, ctx, cfg.sampling, cfg.algo, trainer_version)

    def evaluate(self, cfg: JobConfig, shard: ControllerShard, ctx: ControllerContext, info: DistInfo,
                 moment: str) -> dict[str, float]:
        """Greedy accuracy on the held-out rows of every controller (``eval/accuracy``), or {} without a task."""
        if not cfg.data.task or cfg.data.eval_prompts == 0:
            return {}
        total, count = greedy_accuracy(shard.eval_rows, ctx, cfg.sampling.max_new_tokens,
                                       seed=evaluation_seed(cfg.run.seed))
        reduced = all_reduce_mean({"total": total, "count": float(count)}, info.device)
        return {"eval/accuracy": reduced["total"] / max(reduced["count"], 1.0)}

    def stops(self, cfg: JobConfig, metrics: dict[str, float]) -> bool:
        # the same all-reduced accuracy on every controller, so all stop at this step
        return "eval/accuracy" in metrics and 0 < cfg.run.stop_at_eval_accuracy <= metrics["eval/accuracy"]

    def forecaster(self, cfg: JobConfig, ctx: ControllerContext) -> RolloutForecaster:
        return RolloutForecaster.from_config(cfg, len(ctx.plan.slices[0]))

    def summary(self, cfg: JobConfig, run: Any, wall_seconds: float) -> RunSummary:
        return RunSummary(output_dir=str(Path(cfg.run.output_dir)), steps=len(run.rewards), wall_seconds=wall_seconds,
                          first_reward=run.rewards[0], last_reward=run.rewards[-1],
                          eval_accuracy_before=run.eval_before.get("eval/accuracy"),
                          eval_accuracy_after=run.eval_after.get("eval/accuracy"))

    def frozen_models(self, cfg: JobConfig) -> dict[str, str]:
        return frozen_model_paths(cfg)

    def encode_payload(self, payload: GroupPayload, tensors: dict[str, Tensor]) -> dict[str, Any]:
        return encode_payload(payload)

    def decode_payload(self, entry: dict[str, Any], tensors: dict[str, Tensor], shard: ControllerShard,
                       ctx: ControllerContext) -> GroupPayload:
        """`decode_payload`, and a saved group's completions get their prompt's images again (a checkpoint keeps
        token ids only; the images come from the group's row, re-encoded as rollout encoded it)."""
        payload = decode_payload(entry)
        if ctx.prompts.processor is not None:
            prompt = ctx.prompts(shard.rows[shard.local[payload.row_id]])
            for completion in payload.completions:
                completion.prompt_ids = prompt
        return payload
