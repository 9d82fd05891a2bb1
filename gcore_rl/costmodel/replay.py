"""Replay a measured rollout phase at other splits: the model behind dynamic placement's forecast.

A step's rollout work, counted in tokens (every prompt's, completion's and verdict's length, wave
by wave), does not change when devices move between the policy engine and the judge. Replaying it
through the simulator's phase model (`Partial.rollout`: continuous-batching generation on R
engines, completions streaming to D - R judge engines that batch whatever has arrived) at every
split predicts the rollout phase each split would have taken, with the same cost formulas the
simulator uses everywhere else. The simulator's `dynamic` replays its own steps; the trainer's
controllers replay what they counted (`controller.forecast`), on a one-slice job built from the
run's model configs, a hardware preset and the cost constants (defaults, or those `gcore-rl
simulate --calibrate RUN --constants-out FILE` fitted to a run).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from gcore_rl.costmodel.cost import CostConstants
from gcore_rl.costmodel.hardware import Hardware
from gcore_rl.costmodel.job import Job
from gcore_rl.costmodel.models import EngineFit, ModelSpec
from gcore_rl.costmodel.rollout import feasible_splits, partial_rollout, replay_rollout
from gcore_rl.costmodel.timeline import Timeline
from gcore_rl.costmodel.work import StepWork, Wave, Workload
from gcore_rl.placement.rebalance import RebalanceConfig
from gcore_rl.records import EngineRounds, WaveWork

feasible = feasible_splits  # the splits a slice can take (kept under its older name)


def forecast_vector(times: dict[int, float], slice_devices: int) -> tuple[float, ...]:
    """`RolloutLoad.forecast`: entry r - 1 for r rollout devices, `inf` where r was not replayed."""
    return tuple(times.get(r, math.inf) for r in range(1, slice_devices))


def slice_job(policy: ModelSpec, judge: ModelSpec, hardware: Hardware, costs: CostConstants, slice_devices: int,
              group_size: int, judge_template_tokens: int, max_num_seqs: int, rebalance: RebalanceConfig,
              memory_utilization: float = 0.9) -> Job:
    """A one-slice job of `slice_devices` devices, engines of one device (what the trainer runs)."""
    workload = Workload(group_size=group_size, judge_template_tokens=judge_template_tokens)
    return Job(hardware=hardware, policy=policy, judge=judge, reference=False, policy_tp=1, judge_tp=1, costs=costs,
               workload=workload, gpus=slice_devices, controllers=1, max_num_seqs=max_num_seqs,
               memory_utilization=memory_utilization, offload_trainer=False, rollout_devices=max(1, slice_devices // 2),
               train_devices=max(1, slice_devices // 2), generation_rollout_devices=1, rebalance=rebalance)


def step_work(waves: Sequence[WaveWork], group_size: int) -> StepWork:
    """The counted waves of one controller as the simulator's `StepWork` of one slice.

    A wave without verdict counts (a scalar reward model, no judge) is judged with one-token verdicts.
    """
    sim_waves = []
    for w in waves:
        P = len(w.prompt_tokens)
        verdicts = w.verdict_tokens or (1,) * len(w.response_tokens)
        sim_waves.append(Wave(prompts=P, prompt_tokens=np.asarray(w.prompt_tokens, np.int64).reshape(1, P),
                              response_tokens=np.maximum(np.asarray(w.response_tokens, np.int64), 1).reshape(1, P, group_size),
                              judge_output_tokens=np.maximum(np.asarray(verdicts, np.int64), 1).reshape(1, P, group_size)))
    return StepWork(step=0, valid_fraction=1.0, waves=tuple(sim_waves), trained_groups=0, valid_groups=0,
                    trained_lengths=np.zeros((1, 0), np.int64))


def replay_busy(job: Job, work: StepWork, rollout_devices: int) -> tuple[float, float]:
    """Device-seconds the policy engines and the reward engines spend busy in the rollout phase of
    `work` with `rollout_devices` rollout devices per slice (the replay's timeline, roles `rollout` and
    `judge`): what a run measures as its devices' generate and score busy time at that split."""
    timeline = Timeline(job.gpus)
    partial_rollout(job, work, 0.0, timeline, rollout_devices)
    busy = timeline.busy_seconds()
    return busy["rollout"], busy["judge"]


def scaled_job(job: Job, policy_scale: float, judge_scale: float) -> Job:
    """`job` with the policy's and the judge's engine costs multiplied (`ModelSpec.time_scale`)."""
    judge = replace(job.judge, time_scale=job.judge.time_scale * judge_scale) if job.judge is not None else None
    return replace(job, policy=replace(job.policy, time_scale=job.policy.time_scale * policy_scale), judge=judge)


def fit_time_scales(job: Job, work: StepWork, rollout_devices: int, generate_busy_s: float, score_busy_s: float,
                    iterations: int = 3) -> tuple[float, float]:
    """Per-model factors on the replay's engine costs that make its busy time at the measured split equal
    the measured one: (policy, judge), each the measured busy device-seconds of its side over the
    replayed ones.

    Busy time is linear in a model's own scale, except that a streaming judge's batches depend on
    when completions arrive (the policy's speed); a few fixed-point rounds take that coupling in.
    A side with no measured or no replayed busy time keeps the factor 1. The factors do not move with
    the split (they compare the same work at the same split), which is what lets them carry over to
    the splits the run has not tried.
    """
    policy_scale = judge_scale = 1.0
    for _ in range(iterations):
        generate, score = replay_busy(scaled_job(job, policy_scale, judge_scale), work, rollout_devices)
        if generate > 0 and generate_busy_s > 0:
            policy_scale *= generate_busy_s / generate
        if score > 0 and score_busy_s > 0:
            judge_scale *= score_busy_s / score
    return policy_scale, judge_scale


def fit_engine(rounds: EngineRounds) -> EngineFit | None:
    """An engine's costs from what it did (`EngineRounds`, summed over devices and steps), or None when
    its rounds cannot separate the two decode terms (fewer than 3 rounds, or one batch size only).

    Decode: the least-squares line `seconds ≈ step_s + token_s × B` through the rounds without a prefill
    (from the sums, with both terms kept ≥ 0: a negative slope leaves the mean as the fixed cost, a
    negative intercept the line through 0). Prefill: what the busy time leaves after every decode
    step and the fixed part of every prefill forward, per prefilled token position (≥ 0).
    """
    n, x, y, xx, xy = rounds.rounds, rounds.batch, rounds.seconds, rounds.batch_sq, rounds.batch_seconds
    spread = n * xx - x * x
    if n < 3 or spread <= 1e-9 * max(n * xx, 1.0):
        return None
    token_s = (n * xy - x * y) / spread
    step_s = (y - token_s * x) / n
    if token_s < 0:
        token_s, step_s = 0.0, y / n
    elif step_s < 0:
        step_s, token_s = 0.0, xy / xx
    decode = step_s * (rounds.decode_steps + rounds.prefills) + token_s * rounds.tokens
    prefill = max(rounds.busy_s - decode, 0.0) / rounds.prefill_tokens if rounds.prefill_tokens > 0 else 0.0
    return EngineFit(step_s=step_s, token_s=token_s, prefill_token_s=prefill)


def fitted_job(job: Job, policy: EngineFit | None, judge: EngineFit | None) -> Job:
    """`job` whose policy and judge engines cost what `fit_engine` measured (a model without a fit keeps
    the formulas)."""
    out = replace(job, policy=replace(job.policy, engine=policy)) if policy is not None else job
    if judge is not None and out.judge is not None:
        out = replace(out, judge=replace(out.judge, engine=judge))
    return out


def judge_template_tokens(waves: Sequence[WaveWork]) -> int:
    """Mean tokens a judge prompt adds around the prompt and completion it quotes (0 when not counted)."""
    extra = []
    for w in waves:
        group = len(w.response_tokens) // max(1, len(w.prompt_tokens))
        for i, (judged, response) in enumerate(zip(w.judge_prompt_tokens, w.response_tokens, strict=False)):
            extra.append(judged - w.prompt_tokens[i // group] - response)
    return max(0, round(sum(extra) / len(extra))) if extra else 0


__all__ = ["feasible", "fit_engine", "fit_time_scales", "fitted_job", "forecast_vector", "judge_template_tokens", "replay_busy", "replay_rollout",
           "scaled_job", "slice_job", "step_work"]
