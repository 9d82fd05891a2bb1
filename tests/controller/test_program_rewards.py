"""The rollout phase combines rule rewards, judge verdicts and reward-model scores by their weights."""

from __future__ import annotations

import math

import pytest
import torch
from listed_rows import ListedRows

from gcore_rl.algos.dynamic_sampling import DynamicSamplingConfig, WaveSampler
from gcore_rl.controller.handles import LocalHandle
from gcore_rl.controller.program import (
    ControllerContext,
    pool_reward_stats,
    rollout_phase,
    weight_sample_means,
)
from gcore_rl.controller.seeds import step_seeds
from gcore_rl.controller.slice import SliceClient
from gcore_rl.models.tiny import build_char_tokenizer
from gcore_rl.placement.plan import WorkerSpec, plan
from gcore_rl.records import Completion, Verdict
from gcore_rl.rewards.rule import RewardConfig, RuleRewards
from gcore_rl.rollout.sampling import SamplingConfig
from gcore_rl.telemetry.metrics import PhaseTimer

TOKENIZER = build_char_tokenizer()


class Policy:
    """Answers every prompt with "5" (sample 0) and "4" (sample 1)."""

    def generate_stream(self, prompt_ids, sampling, seed):
        for index, prompt in enumerate(prompt_ids):
            yield [Completion(prompt_index=index, sample_index=k, prompt_ids=prompt,
                              token_ids=TOKENIZER.encode(text, add_special_tokens=False), logprobs=[0.0], finish_reason="stop")
                   for k, text in enumerate(("5", "4"))]


class Scorer:
    """Judge verdict: 1.0 for "5", unparsed (0.25) otherwise; reward model: the answer as a number."""

    def score_samples(self, samples):
        verdicts = [Verdict(10.0, 1.0, True, "10") if s.completion == "5" else Verdict(None, 0.25, False, "?")
                    for s in samples]
        return {"judge": verdicts, "reward_model": [Verdict.of_score(float(s.completion)) for s in samples]}


def _rollout(weights: dict[str, float], ranked: tuple[str, ...] = ()):
    specs = [WorkerSpec(0, 0, ("rollout", "actor"), 0, 1, True, False),
             WorkerSpec(1, 0, ("judge", "reward_model"), None, 1, True, False)]
    layout = plan("partial", 2, ["actor", "rollout", "judge", "reward_model"], rollout_devices=1)
    client = SliceClient([LocalHandle(Policy()), LocalHandle(Scorer())], specs, layout)
    ctx = ControllerContext(workers=client, rewards=RuleRewards(RewardConfig()), tokenizer=TOKENIZER,
                            reward_model_weights=weights, ranked_kinds=ranked)
    rows = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "1+4=", "answer": "5"}]
    waves = WaveSampler(DynamicSamplingConfig(), target_groups=2)
    return rollout_phase(ListedRows(rows), waves, ctx, SamplingConfig(n=2), PhaseTimer(), step_seeds(0, 1, 0))


def test_rule_judge_and_reward_model_add_up_by_weight():
    out = _rollout({"judge": 0.5, "reward_model": 0.1})
    # "5": exact match 1 + 0.5 × 1.0 + 0.1 × 5 = 2.0;  "4": 0 + 0.5 × 0.25 + 0.1 × 4 = 0.525
    assert [g.rewards for g in out.groups.groups] == [pytest.approx((2.0, 0.525))] * 2
    assert out.stats["reward/mean"] == pytest.approx((2.0 + 0.525) / 2)
    assert out.stats["judge/mean_score"] == pytest.approx((1.0 + 0.25) / 2) and out.stats["judge/unparsed"] == 2
    assert out.stats["reward_model/mean_score"] == pytest.approx(4.5)


def test_only_the_configured_models_count():
    out = _rollout({"reward_model": 1.0})
    assert [g.rewards for g in out.groups.groups] == [pytest.approx((6.0, 4.0))] * 2
    assert "judge/mean_score" not in out.stats
    rule_only = _rollout({})
    assert [g.rewards for g in rule_only.groups.groups] == [(1.0, 0.0)] * 2
    assert "reward_model/mean_score" not in rule_only.stats


def test_a_group_softmax_reward_model_ranks_each_prompts_samples_together():
    """``transform: group_softmax``: the reward model's scores (5 and 4, as logits) become each answer's chance of
    ranking first among its prompt's answers, e^5 / (e^5 + e^4) and e^4 / (e^5 + e^4); the raw scores stay the
    verdicts' `score`, and the step's mean score is the transformed one."""
    out = _rollout({"reward_model": 1.0}, ranked=("reward_model",))
    first = 1 / (1 + math.exp(-1))
    assert [g.rewards for g in out.groups.groups] == [pytest.approx((1.0 + first, 1 - first))] * 2
    assert out.stats["reward_model/mean_score"] == pytest.approx(0.5)


def test_reward_mean_and_std_pool_every_sample_of_every_controller():
    # controller A generated rewards [1, 3], controller B [0, 0, 0, 4] (more waves); summed partials:
    summed = {"reward/count": 6.0, "reward/sum": 8.0, "reward/sum_sq": 26.0, "reward/mean": 1.5, "reward/std": 1.3}
    pooled = pool_reward_stats(summed)
    values = torch.tensor([1.0, 3.0, 0.0, 0.0, 0.0, 4.0])
    assert pooled["reward/mean"] == pytest.approx(float(values.mean()))  # 4/3, not the mean of means (1.5)
    assert pooled["reward/std"] == pytest.approx(float(values.std(unbiased=False)))
    assert "reward/sum" not in pooled and "reward/sum_sq" not in pooled and pooled["reward/count"] == 6.0
    # one controller: its own statistics come out unchanged
    local = _rollout({"judge": 0.5, "reward_model": 0.1}).stats
    pooled = pool_reward_stats(weight_sample_means(local))
    for key in ("reward/std", "reward/mean", "judge/mean_score", "reward_model/mean_score", "accuracy"):
        assert pooled[key] == pytest.approx(local[key]), key


def test_per_sample_means_pool_every_sample_of_every_controller():
    # controller A: 2 samples, accuracy 1.0 and judge 0.5; controller B: 6 samples, accuracy 0.0 and judge 1.0
    a = {"reward/count": 2.0, "accuracy": 1.0, "judge/mean_score": 0.5, "sampling/waves": 1.0}
    b = {"reward/count": 6.0, "accuracy": 0.0, "judge/mean_score": 1.0, "sampling/waves": 3.0}
    summed = {key: weight_sample_means(a)[key] + weight_sample_means(b)[key] for key in a}
    pooled = pool_reward_stats(summed)
    assert pooled["accuracy"] == pytest.approx(2 / 8)  # not the mean of the controllers' means (0.5)
    assert pooled["judge/mean_score"] == pytest.approx((2 * 0.5 + 6 * 1.0) / 8)
    assert weight_sample_means(a)["sampling/waves"] == 1.0  # not a per-sample mean: left alone


class GreedyAwarePolicy:
    """Sampled: "5" and "4" per prompt; greedy (temperature 0, one per prompt): "5" for the first prompt, "4" for the second."""

    def __init__(self):
        self.calls = []

    def generate_stream(self, prompt_ids, sampling, seed):
        self.calls.append((sampling.n, sampling.temperature))
        for index, prompt in enumerate(prompt_ids):
            texts = (("5", "4")[index],) if sampling.temperature == 0.0 else ("5", "4")
            yield [Completion(prompt_index=index, sample_index=k, prompt_ids=prompt,
                              token_ids=TOKENIZER.encode(text, add_special_tokens=False), logprobs=[0.0], finish_reason="stop")
                   for k, text in enumerate(texts)]


def test_remax_baseline_is_the_reward_of_one_greedy_completion_per_prompt():
    from gcore_rl.algos.config import AlgoConfig
    from gcore_rl.controller.program import start_update

    policy = GreedyAwarePolicy()
    trained = []

    class Trainer:
        def train(self, batch):
            trained.append(batch)
            return {}

    specs = [WorkerSpec(0, 0, ("rollout", "actor"), 0, 1, True, False)]
    client = SliceClient([LocalHandle(_Both(policy, Trainer()))], specs, plan("colocate", 1, ["actor", "rollout"]))
    ctx = ControllerContext(workers=client, rewards=RuleRewards(RewardConfig()), tokenizer=TOKENIZER, greedy_baseline=True)
    rows = [{"prompt": "2+3=", "answer": "5"}, {"prompt": "1+4=", "answer": "5"}]
    waves = WaveSampler(DynamicSamplingConfig(), target_groups=2)
    sampling = SamplingConfig(n=2)
    out = rollout_phase(ListedRows(rows), waves, ctx, sampling, PhaseTimer(), step_seeds(0, 1, 0))
    assert policy.calls == [(2, sampling.temperature), (1, 0.0)]
    assert [g.payload.greedy_reward for g in out.groups.groups] == [1.0, 0.0]
    assert out.stats["reward/greedy_mean"] == 0.5 and out.stats["reward/greedy_count"] == 2
    assert out.stats["reward/count"] == 4  # greedy samples are not among the sampled rewards
    assert len(out.work) == 1  # the replay of dynamic placement prices the sampled wave only
    pending, _ = start_update(out, ctx, sampling, AlgoConfig(advantage="remax"), trainer_version=0)
    client.finish_train(pending)
    # rewards (1, 0) and (1, 0); baselines 1 and 0: A = r - b; the greedy completions are not in the batch
    assert trained[0].size == 4
    assert trained[0].advantages.tolist() == [0.0, -1.0, 1.0, 0.0]


class _Both:
    """One device hosting the policy and the trainer."""

    def __init__(self, policy, trainer):
        self.policy, self.trainer = policy, trainer

    def generate_stream(self, *args):
        return self.policy.generate_stream(*args)

    def train(self, batch):
        return self.trainer.train(batch)
