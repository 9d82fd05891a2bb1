"""Pixel rule rewards, the rule-reward stack on images, and the scalar image reward model."""

import math

import numpy as np
import pytest
import torch
from transformers import ViTConfig, ViTForImageClassification

from gcore_rl.data.shape_task import draw, shape_rows
from gcore_rl.errors import RewardError
from gcore_rl.records import RewardInput
from gcore_rl.rewards.image import PALETTE, brightness, colour_accuracy, colour_coverage
from gcore_rl.rewards.image_model import ImageRewardModel, ImageRewardModelConfig
from gcore_rl.rewards.rule import RewardConfig, RewardFnConfig, RuleRewards


def _plain(colour, side=8):
    return np.broadcast_to(np.asarray(PALETTE[colour], dtype=np.float32), (side, side, 3)).copy()


def test_colour_coverage_scores_the_named_colour_and_penalises_others():
    black_match = math.exp(-1 / (2 * 0.35**2))  # black is at distance 1 from red
    blue_match = math.exp(-2 / (2 * 0.35**2))  # blue at distance sqrt(2), and fully lit
    assert colour_coverage("", _plain("red"), colour="red") == pytest.approx(1.0)
    assert colour_coverage("", np.zeros((8, 8, 3), np.float32), colour="red") == pytest.approx(black_match)
    assert colour_coverage("", _plain("blue"), colour="red") == pytest.approx(blue_match - 0.5 * (1 - blue_match))
    half = _plain("red")
    half[:4] = 0.0
    assert colour_coverage("", half, colour="red") == pytest.approx(0.5 + 0.5 * black_match)


def test_colour_accuracy_and_brightness_on_drawn_shapes():
    rng = np.random.default_rng(0)
    for row in shape_rows():
        image = draw(row, 16, rng)
        assert colour_accuracy(row["prompt"], image, colour=row["colour"]) == 1.0
        others = [c for c in PALETTE if c != row["colour"]]
        assert colour_accuracy(row["prompt"], image, colour=others[0]) == 0.0
        assert 0 < (image.max(axis=-1) > 0).mean() <= 0.4**2 + 1e-6  # at most a square of 0.4 of the side
    assert colour_accuracy("", np.zeros((4, 4, 3), np.float32), colour="red") == 0.0
    assert brightness("", np.ones((4, 4, 3), np.float32)) == pytest.approx(1.0)


def test_the_rule_reward_stack_scores_images_and_names_a_failing_function():
    rows = shape_rows()[:2]
    images = [_plain(row["colour"]) for row in rows]
    rewards = RuleRewards(RewardConfig(rules=[RewardFnConfig(fn="gcore_rl.rewards.image:colour_coverage", weight=2.0)],
                                       accuracy_fn="gcore_rl.rewards.image:colour_accuracy"))
    out = rewards([RewardInput(row["prompt"], image, row) for row, image in zip(rows, images, strict=True)])
    assert out.rewards == pytest.approx([2.0, 2.0]) and out.accuracy == [1.0, 1.0]
    text_rule = RuleRewards(RewardConfig(rules=[RewardFnConfig(fn="gcore_rl.rewards.image:colour_coverage")], accuracy_fn=None))
    with pytest.raises(RewardError, match="colour_coverage.*image \\[8, 8, 3\\]"):
        text_rule([RewardInput("a red circle", images[0], {"colour": "mauve"})])


def _vit(path, labels=1, nan=False):
    torch.manual_seed(0)
    model = ViTForImageClassification(ViTConfig(image_size=8, patch_size=4, hidden_size=16, num_hidden_layers=1,
                                                num_attention_heads=2, intermediate_size=32, num_labels=labels))
    if nan:
        model.classifier.weight.data.fill_(float("nan"))
    model.save_pretrained(path)
    return path


def test_image_reward_model_gives_one_score_per_image(tmp_path):
    model = ImageRewardModel(ImageRewardModelConfig(model_path=str(_vit(tmp_path / "rm")), batch_size=3))
    images = torch.rand(5, 3, 16, 16)
    scores = model(images)
    assert len(scores) == 5
    assert scores[:2] == pytest.approx(model(images[:2]))  # batching changes nothing


def test_image_reward_model_with_two_outputs_or_nan_weights_is_refused(tmp_path):
    with pytest.raises(RewardError, match="shape \\(2, 2\\).*num_labels=1"):
        ImageRewardModel(ImageRewardModelConfig(model_path=str(_vit(tmp_path / "two", labels=2))))(torch.rand(2, 3, 8, 8))
    with pytest.raises(RewardError, match="non-finite score"):
        ImageRewardModel(ImageRewardModelConfig(model_path=str(_vit(tmp_path / "nan", nan=True))))(torch.rand(2, 3, 8, 8))
