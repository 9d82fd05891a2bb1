"""ScalarRewardModel: last-token scores independent of batching, transforms, truncation, sleep/wake, folder checks."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from gcore_rl.errors import ConfigError, ModelLoadError
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model, write_tiny_reward_model
from gcore_rl.records import RewardInput
from gcore_rl.rewards.reward_model import (
    RewardModelConfig,
    ScalarRewardModel,
    check_reward_model_dir,
    left_pad,
    transform_score,
)

quiet_hf_libraries()
SMALL = TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64, seed=3)


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return write_tiny_reward_model(tmp_path_factory.mktemp("rm") / "rm", SMALL)


def _rm(path, **kwargs) -> ScalarRewardModel:
    return ScalarRewardModel.from_config(RewardModelConfig(enabled=True, model_path=str(path), **kwargs))


SAMPLES = [RewardInput("12+30=", "42", {"answer": "42"}), RewardInput("7+8=", "1", {"answer": "15"}),
           RewardInput("99+99=", "198 and more text", {})]


def test_left_pad_counts_positions_from_each_rows_first_token():
    ids, mask, positions = left_pad([[5, 6, 7], [9]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 9]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert positions.tolist() == [[0, 1, 2], [0, 0, 0]]


def test_scores_are_the_heads_last_token_logit_whatever_the_batch(rm_dir):
    rm = _rm(rm_dir, transform="raw", batch_size=2)
    batched = rm.raw_scores(SAMPLES)
    alone = [rm.raw_scores([s])[0] for s in SAMPLES]
    assert batched == pytest.approx(alone, abs=1e-5)
    # by hand: the unpadded text through the HF classifier, its single logit
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir, local_files_only=True).eval()
    for sample, score in zip(SAMPLES, batched, strict=True):
        ids = torch.tensor([rm.tokenizer.encode(sample.prompt + sample.completion, add_special_tokens=False)])
        with torch.no_grad():
            expected = model(input_ids=ids).logits[0, 0].item()
        assert score == pytest.approx(expected, abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == 3  # different texts, different scores


def test_sigmoid_transform_template_and_truncation(rm_dir):
    raw = _rm(rm_dir, transform="raw").raw_scores(SAMPLES)
    squashed = _rm(rm_dir).score(SAMPLES)  # sigmoid is the default
    assert squashed == pytest.approx([1 / (1 + math.exp(-r)) for r in raw], abs=1e-6)
    assert transform_score(-800.0, "sigmoid") == pytest.approx(0.0) and transform_score(800.0, "sigmoid") == 1.0
    templated = _rm(rm_dir, transform="raw", template="{prompt}{answer}|{completion}")
    assert templated.render(SAMPLES[1]) == "7+8=15|1" and templated.render(SAMPLES[2]) == "99+99=|198 and more text"
    # only the last max_length tokens are scored
    short = _rm(rm_dir, transform="raw", max_length=4)
    tail = RewardInput("", SAMPLES[2].completion[-4:], {})
    assert short.raw_scores([SAMPLES[2]])[0] == pytest.approx(short.raw_scores([tail])[0], abs=1e-6)


def test_sleep_releases_weights_and_wake_restores_the_same_scores(rm_dir):
    rm = _rm(rm_dir, transform="raw")
    before = rm.raw_scores(SAMPLES)
    assert rm.sleep() == rm.weight_bytes() > 0 and rm.sleep() == 0
    with pytest.raises(RuntimeError, match="asleep"):
        rm.raw_scores(SAMPLES)
    rm.wake()
    assert rm.raw_scores(SAMPLES) == pytest.approx(before, abs=0)


def test_folders_that_are_not_scalar_reward_models_are_refused(tmp_path):
    causal = write_tiny_model(tmp_path / "causal", SMALL)
    with pytest.raises(ModelLoadError, match="not a sequence-classification model"):
        check_reward_model_dir(str(causal))
    two = AutoModelForSequenceClassification.from_pretrained(causal, num_labels=2, local_files_only=True)
    two.save_pretrained(tmp_path / "two")
    with pytest.raises(ModelLoadError, match="2 labels"):
        check_reward_model_dir(str(tmp_path / "two"))
    with pytest.raises(ModelLoadError, match="does not exist"):
        check_reward_model_dir(str(tmp_path / "missing"))


@pytest.mark.parametrize(("kwargs", "key"), [
    ({"enabled": True}, "model_path"),
    ({"template": "{prompt}"}, "template"),
    ({"transform": "tanh"}, "transform"),
    ({"batch_size": 0}, "batch_size"),
    ({"weight": float("nan")}, "weight"),
])
def test_bad_config_names_the_key(kwargs, key):
    with pytest.raises(ConfigError) as info:
        RewardModelConfig(**kwargs).validate()
    assert info.value.key == key


def test_group_softmax_is_each_answers_chance_of_ranking_first_among_its_prompts_answers():
    from gcore_rl.rewards.reward_model import group_softmax

    # prompt 0: answers a (twice), b, c; prompt 1: one answer sampled twice
    scores = [2.0, 2.0, 0.0, -1.0, 3.0, 3.0]
    groups = [0, 0, 0, 0, 1, 1]
    answers = ["a", "a", "b", "c", "a", "a"]
    total = math.exp(2.0) + math.exp(0.0) + math.exp(-1.0)  # distinct answers count once
    expected = [math.exp(2.0) / total] * 2 + [1 / total, math.exp(-1.0) / total, 1.0, 1.0]
    assert group_softmax(scores, groups, answers) == pytest.approx(expected)
    # a hedge the model half-likes on every prompt (sigmoid 0.6) earns little beside an answer it is sure of
    correct, hedge, wrong = 6.9, 0.4, -6.9
    rewards = group_softmax([correct, hedge, wrong], [0, 0, 0], ["3", "2", "1"])
    assert rewards[1] < 0.002 and transform_score(hedge, "sigmoid") > 0.59
    # large logits do not overflow; the raw score passes through transform_score unchanged
    assert group_softmax([900.0, 899.0], [0, 0], ["x", "y"]) == pytest.approx([1 / (1 + math.exp(-1)), 1 / (1 + math.e)])
    assert transform_score(1.5, "group_softmax") == 1.5
