"""A vision-language judge: it sees the prompt's images and, for a diffusion policy, the generated image."""

from __future__ import annotations

import numpy as np
import pytest

from gcore_rl.errors import RewardError
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import RewardInput, VisionPrompt
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.judge_role import JudgeRewarder


class _Recording:
    """Wraps the judge's engine to keep the prompts it was given."""

    def __init__(self, engine):
        self.engine, self.prompts = engine, []

    def generate(self, prompts, params, seed=None):
        self.prompts.extend(prompts)
        return self.engine.generate(prompts, params, seed=seed)


def test_a_vision_judge_reads_the_prompt_images_and_image_completions(vlm_dir, random_image):
    judge = JudgeRewarder.from_config(JudgeConfig(enabled=True, model_path=str(vlm_dir), max_new_tokens=3))
    assert judge.processor is not None
    recording = judge.engine = _Recording(judge.engine)
    question = RewardInput(prompt="U:<image>colour?", completion="red", row={"answer": "red", "images": [random_image(0)]})
    other = RewardInput(prompt="U:<image>colour?", completion="red", row={"answer": "red", "images": [random_image(1)]})
    drawn = RewardInput(prompt="a red circle", completion=np.random.default_rng(0).random((16, 16, 3)), row={})
    text = RewardInput(prompt="1+1=", completion="2", row={"answer": "2"})
    verdicts, stats = judge.score([question, other, drawn, text])
    assert len(verdicts) == 4 and stats is not None
    first, second, image, plain = recording.prompts
    assert isinstance(first, VisionPrompt) and first.images.count == 1
    assert list(first) == list(second)  # same text ...
    assert not np.array_equal(first.images.pixel_values.numpy(), second.images.pixel_values.numpy())  # ... other pixels
    assert isinstance(image, VisionPrompt) and image.images.count == 1  # the generated image, in place of {completion}
    assert not isinstance(plain, VisionPrompt)
    assert verdicts[0].prompt_tokens == len(first)


def test_a_text_judge_refuses_an_image_completion(tmp_path):
    path = write_tiny_model(tmp_path / "judge", TinyModelConfig(hidden_size=32, num_layers=1, intermediate_size=64))
    judge = JudgeRewarder.from_config(JudgeConfig(enabled=True, model_path=str(path), max_new_tokens=2))
    with pytest.raises(RewardError, match="text-only model and the completion is an image"):
        judge.score([RewardInput(prompt="a red circle", completion=np.zeros((8, 8, 3)), row={})])
