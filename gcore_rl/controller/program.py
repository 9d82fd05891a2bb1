"""The RL program one controller runs over its prompt shard: one function per phase of a step.

    rollout (generate → rule rewards, judge / reward model on finished completions) in waves → update (prepare + train
    on the slice's trainer workers) → sync weights to the slice's engines

Every controller runs this same program (SPMD) on its own shard and its own device slice (a
`SliceClient`); the only cross-controller traffic is the FSDP collectives among the trainer
workers and the all-reduce of the step's metrics. `run_controller` (controller/loop.py) calls the
phases in order, or overlaps the next steps' rollouts with this step's update (`disaggregated`,
bounded staleness `placement.max_staleness`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from gcore_rl.algos.config import AlgoConfig
from gcore_rl.algos.dynamic_sampling import Group, StepBatch, WaveSampler
from gcore_rl.algos.registry import ADVANTAGES, AdvantageInputs, compute_advantages
from gcore_rl.config import JobConfig, model_reward_weights
from gcore_rl.controller.seeds import StepSeeds
from gcore_rl.controller.slice import SliceClient
from gcore_rl.data.prompts import PromptEncoder, policy_prompt_encoder
from gcore_rl.distributed import DistInfo
from gcore_rl.placement.plan import Plan
from gcore_rl.records import Completion, RewardInput, Verdict, WaveWork, build_token_batch
from gcore_rl.rewards.judge import combine_rewards
from gcore_rl.rewards.kinds import generates, reward_kinds
from gcore_rl.rewards.overlong import overlong_penalties, truncated_keep_mask
from gcore_rl.rewards.reward_model import GROUP_SOFTMAX, group_softmax
from gcore_rl.rewards.rule import RewardOutput, RuleRewards
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.telemetry.metrics import PhaseTimer


@dataclass
class ControllerContext:
    """What one controller drives: its slice's workers (with the current plan), the rule rewards and
    the tokenizer (and the `PromptEncoder` that turns prompt rows, images included, into engine prompts).

    `reward_model_weights` maps each reward model of the job (``judge``, ``reward_model``) to its
    weight in the reward; a sample's reward is its weighted rule reward plus these models'
    weighted scores (`combine_rewards`). Empty: rule rewards only. `ranked_kinds` names the reward models whose
    scores become rewards over each prompt's samples together (``reward_model.transform: group_softmax``:
    `group_verdicts`). With `greedy_baseline` (ReMax)
    every wave also generates and rewards one greedy completion per prompt, whose reward is the
    baseline of that prompt's samples (`GroupPayload.greedy_reward`); it is never trained on.
    """

    workers: SliceClient
    rewards: RuleRewards
    tokenizer: PreTrainedTokenizerBase | None
    reward_model_weights: dict[str, float] = field(default_factory=dict)
    ranked_kinds: tuple[str, ...] = ()  # reward models whose scores are ranked within each prompt's samples
    greedy_baseline: bool = False
    prompts: PromptEncoder | None = None  # rows → engine prompts (None: the tokenizer's, text only)
    clock: Callable[[], float] = time.perf_counter  # what the controller times its phases with (a test: counted work)
    samples: SampleKind | None = None  # the policy kind's samples (None: a language policy's, `TokenSamples`)

    def __post_init__(self) -> None:
        if self.prompts is None and self.tokenizer is not None:
            self.prompts = PromptEncoder(self.tokenizer)
        if self.samples is None:
            from gcore_rl.controller.token_samples import TokenSamples  # it builds on this module

            self.samples = TokenSamples()

    @classmethod
    def for_job(cls, cfg: JobConfig, workers: SliceClient, tokenizer: PreTrainedTokenizerBase) -> ControllerContext:
        """The context of a controller of job `cfg` (both runtimes build it here): rule rewards, reward model
        weights, and the policy's prompt encoder (with its image processor for a vision-language policy)."""
        return cls(workers=workers, rewards=RuleRewards(cfg.reward), tokenizer=tokenizer,
                   reward_model_weights=model_reward_weights(cfg), greedy_baseline=cfg.algo.greedy_baseline,
                   ranked_kinds=(("reward_model",) if cfg.reward_model.enabled
                                 and cfg.reward_model.transform == GROUP_SOFTMAX else ()),
                   prompts=policy_prompt_encoder(cfg.model.path, tokenizer))

    @property
    def plan(self) -> Plan:
        """The placement plan the slice runs now (a dynamic move replaces it with its next version)."""
        return self.workers.plan


SUMMED_METRICS = frozenset({
    "sampling/generated_groups", "sampling/padded_groups", "rollout/generated_tokens", "throughput/tokens_per_s",
    "reward/errors", "reward/timeouts", "reward/count", "reward/sum", "reward/sum_sq",
    "data/prompts_truncated", "data/prompts_dropped", "overlong/filtered_samples", "reward/greedy_count",
    "rollout/inserted_tokens", "sampling/stale_dropped", "rollout/generated_images", "throughput/images_per_s",
})
"""Step metrics that add up over controllers (counts, totals, throughput), besides each generating reward
model's ``<kind>/unparsed`` (`is_summed`); the others are averaged or maxed."""


SAMPLE_MEAN_COUNTS = {"accuracy": "reward/count", "overlong/mean_penalty": "reward/count",
                      "reward/greedy_mean": "reward/greedy_count"}
"""Step metrics that are means over the step's samples, with the (summed) count each averages over, besides
each reward model's ``<kind>/mean_score`` (over ``reward/count``; `sample_mean_count`); pooled over controllers
weighted by that count (`weight_sample_means` before the all-reduce, `pool_reward_stats` after)."""


def is_summed(key: str) -> bool:
    """Whether the step metric `key` adds up over controllers (`SUMMED_METRICS`, a reward model's unparsed count)."""
    return key in SUMMED_METRICS or (key.endswith("/unparsed") and key.removesuffix("/unparsed") in reward_kinds())


def sample_mean_count(key: str) -> str | None:
    """The count the sample mean `key` averages over (`SAMPLE_MEAN_COUNTS`), or None for a metric that is not one."""
    if key.endswith("/mean_score") and key.removesuffix("/mean_score") in reward_kinds():
        return "reward/count"
    return SAMPLE_MEAN_COUNTS.get(key)


def weight_sample_means(metrics: dict[str, float]) -> dict[str, float]:
    """A controller's sample means (`sample_mean_count`) times their sample counts, to be summed over controllers."""
    counts = {key: sample_mean_count(key) for key in metrics}
    return {key: value * metrics.get(counts[key], 0.0) if counts[key] else value for key, value in metrics.items()}


def pool_reward_stats(metrics: dict[str, float]) -> dict[str, float]:
    """Set `reward/mean` and `reward/std` of all samples from the summed `reward/sum`, `reward/sum_sq`, `reward/count`.

    The partial sums are removed, and the summed sample means (see `weight_sample_means`) are divided
    by the total count. Controllers may generate different numbers of samples (dynamic sampling), so
    averaging their means and stds would weight samples unequally.
    """
    out = dict(metrics)
    total, squares, count = out.pop("reward/sum", None), out.pop("reward/sum_sq", None), out.get("reward/count", 0.0)
    for key in list(out):
        count_key = sample_mean_count(key)
        if count_key is not None:
            samples = out.get(count_key, 0.0)
            out[key] = out[key] / samples if samples > 0 else 0.0
    if total is not None and squares is not None and count > 0:
        mean = total / count
        out["reward/mean"] = mean
        out["reward/std"] = max(squares / count - mean * mean, 0.0) ** 0.5
    return out


@dataclass
class GroupPayload:
    """What a dynamic-sampling `Group` carries for the trainer: its prompt's global row number, its
    n completions and, under ReMax, the reward of its prompt's greedy completion."""

    row_id: int
    completions: list[Completion]
    greedy_reward: float | None = None


@dataclass
class StepRollout:
    """The groups one step trains on, the global rows it drew (all waves, in order), and statistics
    of everything generated for them."""

    groups: StepBatch
    stats: dict[str, float]
    row_ids: list[int] = field(default_factory=list)
    work: tuple = ()  # each wave's counted work (a `WaveWork`, or an image wave's; dynamic placement's; not checkpointed)


class SampleKind(Protocol):
    """What the shared step loop (controller/loop.py) and `rollout_phase` ask of a policy kind about its samples:
    the language kind's tokens (`controller/token_samples.py`) or a diffusion policy's images
    (`diffusion/samples.py`). Everything else of a step (the schedule, rebalancing, checkpoints, records,
    health, preemption, resume) is the same code for every kind."""

    log_samples: bool
    """Whether a few samples of each step go to ``samples.jsonl`` as text (`controller/samples.py`)."""

    def load_shard(self, cfg: Any, ctx: ControllerContext, info: DistInfo) -> Any:
        """This controller's data (a `ControllerShard`)."""
        ...

    def wave(self, rows: list[dict], ctx: ControllerContext, sampling: Any, timer: PhaseTimer, tally: RewardTally,
             seed: int, trained: bool = True) -> WaveRewards:
        """One wave: `sampling.n` samples of each row, rewarded (rule rewards and the reward models), added to `tally`."""
        ...

    def start_update(self, rollout: StepRollout, ctx: ControllerContext, cfg: Any,
                     trainer_version: int) -> tuple[list, dict[str, float]]:
        """Send the step's batch to the trainers: the pending results (`SliceClient.finish_train`) and batch statistics."""
        ...

    def evaluate(self, cfg: Any, shard: Any, ctx: ControllerContext, info: DistInfo, moment: str) -> dict[str, float]:
        """The held-out evaluation (``eval/*`` metrics, the same on every controller; a collective), `moment`
        ``"before"`` the first step or ``"after"`` an update; {} for a job without one."""
        ...

    def stops(self, cfg: Any, metrics: dict[str, float]) -> bool:
        """Whether the run ends after the step of `metrics` (an evaluation reached the job's target)."""
        ...

    def forecaster(self, cfg: Any, ctx: ControllerContext) -> Any:
        """Dynamic placement's forecaster of the rollout phase at every split (`rebalance_split`)."""
        ...

    def summary(self, cfg: Any, run: Any, wall_seconds: float) -> Any:
        """What the finished run reports (a dataclass, written as ``summary.json``) from its `RunProgress`."""
        ...

    def frozen_models(self, cfg: Any) -> dict[str, str]:
        """The frozen models a checkpoint refers to, by role."""
        ...

    def encode_payload(self, payload: GroupPayload, tensors: dict[str, Tensor]) -> dict[str, Any]:
        """A group's payload as JSON for a checkpoint; tensors too large for JSON go into `tensors` under keys of
        their own (written beside the JSON)."""
        ...

    def decode_payload(self, entry: dict[str, Any], tensors: dict[str, Tensor], shard: Any,
                       ctx: ControllerContext) -> GroupPayload:
        """The inverse of `encode_payload`."""
        ...


class PromptRows(Protocol):
    """A controller's prompt rows (its `ControllerShard`)."""

    def draw(self, count: int) -> list[tuple[int, dict]]:
        """The next `count` prompt rows of the shard, each with its global row number."""
        ...

    def rows_of(self, row_ids: Sequence[int]) -> list[tuple[int, dict]]:
        """The shard's rows of the global row numbers `row_ids`, each with its number."""
        ...


def rollout_phase(prompts: PromptRows, waves: WaveSampler, ctx: ControllerContext, sampling: SamplingConfig,
                  timer: PhaseTimer, seeds: StepSeeds, trained_version: int | None = None) -> StepRollout:
    """Generate and reward wave after wave until the step's groups are complete.

    The waves draw their prompts from `prompts`. Buffered surplus groups that would lag the trainer (at
    `trained_version` when it trains this step's batch) by more than the sampler allows are not trained
    on; their prompts are generated again first. Rule rewards run here as completions finish; the reward
    models (if any) run on the slice's reward devices meanwhile. The statistics cover every sample
    generated in the step (reward, accuracy, waves, valid fraction), so metrics describe the policy, not
    the filter.
    """
    again = deque(prompts.rows_of([group.payload.row_id for group in waves.begin_step(trained_version)]))
    tally = RewardTally()
    greedy_tally = RewardTally() if ctx.greedy_baseline else None
    wave = 0
    drawn: list[int] = []
    work: list[WaveWork] = []
    while (count := waves.next_wave_size()) > 0:
        returned = [again.popleft() for _ in range(min(count, len(again)))]
        row_ids, rows = zip(*returned, *prompts.draw(count - len(returned)), strict=True)
        drawn.extend(row_ids)
        rewards = ctx.samples.wave(list(rows), ctx, sampling, timer, tally, seed=seeds.wave(wave))
        work.append(rewards.work)
        greedy = [None] * len(rows)
        if greedy_tally is not None:  # ReMax: one greedy completion per prompt, rewarded like the samples
            baseline = ctx.samples.wave(list(rows), ctx, greedy_sampling(sampling), timer, greedy_tally,
                                     seed=seeds.wave(wave), trained=False)
            # its work is not in `work`: dynamic placement's replay prices waves of `sampling.n` samples per prompt
            greedy = baseline.rewards
        n = sampling.n
        waves.add_wave([Group(key=i, rewards=tuple(rewards.rewards[i * n:(i + 1) * n]),
                              payload=GroupPayload(row_id=row_id, completions=rewards.completions[i * n:(i + 1) * n],
                                                   greedy_reward=greedy[i]),
                              version=min(c.policy_version for c in rewards.completions[i * n:(i + 1) * n]))
                        for i, row_id in enumerate(row_ids)])
        wave += 1
    step_groups = waves.finish_step()
    stats = {
        **tally.stats(),
        "sampling/waves": float(step_groups.waves),
        "sampling/generated_groups": float(step_groups.generated_groups),
        "sampling/valid_fraction": step_groups.valid_fraction_observed,
        "sampling/padded_groups": float(len(step_groups.mask) - sum(step_groups.mask)),
        "sampling/ema_valid_fraction": waves.ema,
        **({"sampling/stale_dropped": float(step_groups.stale_dropped)} if waves.max_age is not None else {}),
    }
    if greedy_tally is not None:
        greedy_stats = greedy_tally.stats()
        stats["reward/greedy_mean"] = greedy_stats["reward/mean"]
        stats["reward/greedy_count"] = greedy_stats["reward/count"]
        stats["reward/errors"] += greedy_stats["reward/errors"]
        if "reward/timeouts" in greedy_stats:
            stats["reward/timeouts"] = stats.get("reward/timeouts", 0.0) + greedy_stats["reward/timeouts"]
    return StepRollout(groups=step_groups, stats=stats, row_ids=drawn, work=tuple(work))


def greedy_sampling(sampling: SamplingConfig) -> SamplingConfig:
    """One greedy (temperature 0) completion per prompt, as long as the samples may be (ReMax's baseline)."""
    return SamplingConfig(n=1, max_new_tokens=sampling.max_new_tokens, temperature=0.0)


@dataclass
class WaveRewards:
    """One wave's samples (prompt-major: `Completion`s, or a diffusion policy's images), their rewards, its work."""

    completions: list  # prompt-major
    rewards: list[float]  # one per completion
    work: Any  # the wave's counted work (a `WaveWork` of tokens; an image wave's `ImageWork`)


class RewardTally:
    """Running reward statistics over all waves of a step."""

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.accuracy: list[float] = []
        self.errors = 0
        self.timeouts: int | None = None  # counted when the rule rewards run in a pool with a time limit
        self.model_verdicts: dict[str, list[Verdict]] = {}  # by reward kind
        self.overlong_penalties: list[float] = []

    def add(self, rewards: list[float], accuracy: list[float], verdicts: dict[str, list[Verdict]]) -> None:
        """Count a wave's rewards, accuracy scores and the reward models' verdicts (by kind)."""
        self.rewards.extend(rewards)
        self.accuracy.extend(accuracy)
        for kind, said in verdicts.items():
            self.model_verdicts.setdefault(kind, []).extend(said)

    def count_rule(self, scored: RewardOutput, pooled: bool) -> None:
        """Count the errors of a chunk's rule rewards, and their time-outs when they run in a pool (`pooled`)."""
        self.errors += scored.error_count
        if pooled:
            self.timeouts = (self.timeouts or 0) + scored.timeout_count

    def stats(self) -> dict[str, float]:
        rewards = torch.tensor(self.rewards, dtype=torch.float64) if self.rewards else torch.zeros(1, dtype=torch.float64)
        out = {"reward/mean": float(rewards.mean()), "reward/std": float(rewards.std(unbiased=False)),
               "reward/errors": float(self.errors), "reward/count": float(len(self.rewards)),
               "reward/sum": float(rewards.sum()), "reward/sum_sq": float((rewards**2).sum())}
        if self.timeouts is not None:
            out["reward/timeouts"] = float(self.timeouts)
        if self.accuracy:
            out["accuracy"] = sum(self.accuracy) / len(self.accuracy)
        for kind, verdicts in self.model_verdicts.items():
            if verdicts:
                out[f"{kind}/mean_score"] = sum(v.reward for v in verdicts) / len(verdicts)
                if generates(kind):  # a generated verdict may not parse
                    out[f"{kind}/unparsed"] = float(sum(not v.parsed for v in verdicts))
        if self.overlong_penalties:
            out["overlong/mean_penalty"] = sum(self.overlong_penalties) / len(self.overlong_penalties)
        return out


def wave_rewards(rows: list[dict], ctx: ControllerContext, sampling: SamplingConfig, timer: PhaseTimer, tally: RewardTally,
                  seed: int, trained: bool = True) -> WaveRewards:
    """One wave: generate n completions per row, rule-reward each as it finishes, add the reward models' scores.

    `trained`: the completions may be trained on, so a plan that computes reference log-probs in the
    rollout phase (`interleave`) computes them (ReMax's greedy completions are not trained on)."""
    rule: dict[tuple[int, int], float] = {}
    accuracy: list[float] = []

    def on_finished(chunk: list[Completion]) -> list[RewardInput]:
        texts = decode_completions(ctx.tokenizer, chunk)
        inputs = [RewardInput(prompt=rows[c.prompt_index]["prompt"], completion=text, row=rows[c.prompt_index])
                  for c, text in zip(chunk, texts, strict=True)]
        with timer.phase("rollout/reward"):
            scored = ctx.rewards(inputs)
        rule.update(((c.prompt_index, c.sample_index), r) for c, r in zip(chunk, scored.rewards, strict=True))
        accuracy.extend(scored.accuracy or [])
        tally.count_rule(scored, pooled=ctx.rewards.cfg.workers > 0)
        if not ctx.reward_model_weights:
            return []
        # the reward models need the texts, the reference answer and the prompt's images (a vision-language
        # judge looks at them), not the rest of the row
        return [RewardInput(prompt=i.prompt, completion=i.completion, row=_model_reward_row(i.row)) for i in inputs]

    prompt_ids = ctx.prompts.encode_rows(rows)
    with timer.phase("rollout"):
        result = ctx.workers.rollout_and_score(prompt_ids, sampling, seed, on_finished, reference=trained)
    for completion in result.completions:  # the trainer reads a prompt's images from here (`build_token_batch`);
        # an agent's sample began from a prompt of its own (`agent_loop`), which it keeps
        if list(completion.prompt_ids) == list(prompt_ids[completion.prompt_index]):
            completion.prompt_ids = prompt_ids[completion.prompt_index]
    components = {"rule": [rule[k] for k in result.keys()]}
    verdicts = group_verdicts(result.verdicts(ctx.reward_model_weights), ctx.ranked_kinds, result.completions)
    components.update({kind: [v.reward for v in said] for kind, said in verdicts.items()})
    shaping = ctx.rewards.cfg
    if shaping.overlong_buffer > 0:  # DAPO's soft overlong punishment, added to the reward
        components["overlong"] = overlong_penalties([len(c.token_ids) for c in result.completions], sampling.max_new_tokens,
                                                    shaping.overlong_buffer, shaping.overlong_penalty)
        tally.overlong_penalties.extend(components["overlong"])
    # an environment's rewards (`env_turns`; 0 for samples without any)
    components["environment"] = [c.environment_reward for c in result.completions]
    rewards = combine_rewards(components, {"rule": 1.0, "overlong": 1.0, "environment": 1.0, **ctx.reward_model_weights})
    tally.add(rewards, accuracy, verdicts)
    return WaveRewards(completions=result.completions, rewards=rewards,
                        work=wave_work(prompt_ids, result.completions,
                                       [said for kind, said in verdicts.items() if generates(kind)]))


def group_verdicts(verdicts: dict[str, list[Verdict]], ranked: Sequence[str],
                   completions: list[Completion]) -> dict[str, list[Verdict]]:
    """`verdicts` (each kind's, in the completions' order) with the rewards of each kind in `ranked` taken over each
    prompt's samples together (`group_softmax`; two samples are the same answer when their tokens are), the raw
    scores kept as each verdict's `score`."""
    out = dict(verdicts)
    for kind in ranked:
        said = verdicts.get(kind)
        if said:
            rewards = group_softmax([v.reward for v in said], [c.prompt_index for c in completions],
                                    [tuple(c.token_ids) for c in completions])
            out[kind] = [replace(v, reward=r) for v, r in zip(said, rewards, strict=True)]
    return out


def _model_reward_row(row: dict) -> dict:
    """What of a prompt row the reward models get: its answer, and its images when it has any."""
    return {"answer": row.get("answer"), **({"images": row["images"]} if row.get("images") else {})}


def wave_work(prompt_ids: list[list[int]], completions: list[Completion], judged: list[list[Verdict]]) -> WaveWork:
    """The wave's counted work (`WaveWork`) from its prompts and its completions, and the verdicts of each
    generating reward model (`judged`: one list per kind, each in the completions' order; their tokens add up)."""
    order = sorted(range(len(completions)), key=lambda i: (completions[i].prompt_index, completions[i].sample_index))

    def tokens(of: Callable[[Verdict], int]) -> tuple[int, ...]:
        return tuple(sum(of(verdicts[i]) for verdicts in judged) for i in order) if judged else ()

    return WaveWork(prompt_tokens=tuple(len(p) for p in prompt_ids),
                    response_tokens=tuple(len(completions[i].token_ids) for i in order),
                    verdict_tokens=tokens(lambda v: v.tokens), judge_prompt_tokens=tokens(lambda v: v.prompt_tokens))


def start_update(rollout: StepRollout, ctx: ControllerContext, sampling: SamplingConfig, algo: AlgoConfig,
                 trainer_version: int) -> tuple[list, dict[str, float]]:
    """Lay out the step's batch with its advantages (`algo.advantage`) and send it to the trainer workers.

    An estimator that needs the critic's values (GAE) goes with its rewards instead (`batch.rewards`):
    the trainer workers compute the advantages after their preparation pass.

    Returns the pending trainer results (`SliceClient.finish_train`) and the batch statistics.
    Padding groups get `response_mask = 0`, so they add nothing to the loss or its denominator; so do
    truncated completions under `algo.overlong_filter` (DAPO's overlong filtering).
    `trainer_version` (updates done so far) gives the samples' staleness.
    """
    groups = rollout.groups.groups
    completions = [c for group in groups for c in group.payload.completions]
    rewards = torch.tensor([r for group in groups for r in group.rewards], dtype=torch.float32)
    batch = build_token_batch(completions, ctx.tokenizer.pad_token_id)
    keep = torch.tensor(rollout.groups.mask, dtype=torch.float32).repeat_interleave(sampling.n)
    scored_mask = batch.response_mask * keep.unsqueeze(-1)  # padding groups out of batch-wide statistics
    if ADVANTAGES[algo.advantage].on_trainer:  # GAE: the trainer workers have the critic's values
        # an environment's rewards go in at their turns' tokens (`batch.turn_rewards`), the rest at the last token
        batch.rewards = rewards - torch.tensor([c.environment_reward for c in completions], dtype=torch.float32)
    else:
        batch.turn_rewards = None  # in `rewards` already: group estimators see the trajectory's return
        greedy = None
        if "greedy_rewards" in ADVANTAGES[algo.advantage].needs:
            greedy = torch.tensor([g.payload.greedy_reward for g in groups], dtype=torch.float32).repeat_interleave(sampling.n)
        batch.advantages = compute_advantages(algo, AdvantageInputs(rewards, sampling.n, scored_mask, greedy_rewards=greedy))
    stats = rollout_metrics(completions, trainer_version)
    if algo.overlong_filter:
        untruncated = torch.tensor(truncated_keep_mask([c.finish_reason for c in completions]))
        stats["overlong/filtered_samples"] = float(((1.0 - untruncated) * keep).sum())
        keep = keep * untruncated
    batch.response_mask = batch.response_mask * keep.unsqueeze(-1)
    batch.staleness = torch.tensor([trainer_version - c.policy_version for c in completions], dtype=torch.long)
    return ctx.workers.start_train(batch), stats


def final_turn(completion: Completion) -> list[int]:
    """The ids a reward reads: the whole completion, or of a multi-turn one (inserted tokens in it) its last run of
    the policy's own tokens, the final turn, so a tool's answer is never taken for something the policy wrote."""
    mask = completion.loss_mask
    if mask is None or 0 not in mask:
        return completion.token_ids
    end = max(i for i, m in enumerate(mask) if m) + 1 if any(mask) else 0
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return completion.token_ids[start:end]


def decode_completions(tokenizer: PreTrainedTokenizerBase, completions: list[Completion]) -> list[str]:
    """Completion texts as rewards read them, without special tokens (the EOS that ended a completion is dropped);
    a multi-turn completion's final turn only (`final_turn`)."""
    if not completions:  # transformers' batch_decode([]) returns [''], one text for no completion
        return []
    return tokenizer.batch_decode([final_turn(c) for c in completions], skip_special_tokens=True)


def rollout_metrics(completions: list[Completion], trainer_version: int) -> dict[str, float]:
    """Length, truncation and staleness (trainer updates since the policy that sampled them) of the trained
    completions; `rollout/generated_tokens` counts the policy's tokens, and `rollout/inserted_tokens` (only when
    a rollout function inserted some) the others; each count a rollout function reports per sample
    (`Completion.rollout_stats`) as its mean, `rollout/<name>`."""
    lengths = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.float32)
    policy_tokens = float(sum(c.policy_token_count for c in completions))
    staleness = [trainer_version - c.policy_version for c in completions]
    inserted = ({"rollout/inserted_tokens": float(lengths.sum()) - policy_tokens}
                if any(c.loss_mask is not None for c in completions) else {})
    counted = [c.rollout_stats for c in completions if c.rollout_stats]
    per_sample = {f"rollout/{name}": sum(s.get(name, 0.0) for s in counted) / len(counted)
                  for name in sorted({name for s in counted for name in s})}
    return {
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "response/truncated_fraction": sum(c.finish_reason == "length" for c in completions) / len(completions),
        "rollout/generated_tokens": policy_tokens,
        **inserted,
        **per_sample,
        "rollout/staleness_max": float(max(staleness)),
        "rollout/staleness_mean": sum(staleness) / len(staleness),
    }


@torch.no_grad()
def greedy_accuracy(rows: list[dict], ctx: ControllerContext, max_new_tokens: int, seed: int) -> tuple[float, int]:
    """(sum of accuracy scores, count) of greedy completions on held-out rows of this controller."""
    if not rows:
        return 0.0, 0
    greedy = SamplingConfig(n=1, max_new_tokens=max_new_tokens, temperature=0.0)
    completions = ctx.workers.generate(ctx.prompts.encode_rows(rows), greedy, seed=seed)
    texts = decode_completions(ctx.tokenizer, completions)
    scored = ctx.rewards([RewardInput(prompt=row["prompt"], completion=text, row=row) for row, text in zip(rows, texts, strict=True)])
    scores = scored.accuracy if scored.accuracy is not None else scored.rewards
    return float(sum(scores)), len(scores)
