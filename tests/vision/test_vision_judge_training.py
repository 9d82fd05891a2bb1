"""A vision-language judge trained by `gcore-rl sft` on `judge_shapes` grades answers about project-drawn
pictures: it reads the picture, so a wrong colour (text alike to a right one) gets a low verdict."""

from __future__ import annotations

import pytest

from gcore_rl.data.config import DataConfig
from gcore_rl.data.tasks import attach_task_images, make_task_rows
from gcore_rl.models.loading import ModelConfig, quiet_hf_libraries
from gcore_rl.records import RewardInput
from gcore_rl.rewards.judge import JudgeConfig
from gcore_rl.rewards.judge_role import JudgeRewarder
from gcore_rl.training.sft import SftConfig, run_sft

pytestmark = pytest.mark.slow  # training a vision judge: `make test-slow`

quiet_hf_libraries()


def test_an_sft_trained_vision_judge_scores_right_answers_high_and_wrong_colours_low(vlm_dir, tmp_path):
    # colour questions about 16 px pictures, 500 steps, 1 thread. Measured 2026-11-27 on seeds 0-2 x 1 and 2
    # threads (2-core x86 CPU): held-out verdict accuracy 0.0 -> 0.992-1.000 (300 steps: 0.81-1.00; always
    # answering "10" gives 0.5)
    cfg = SftConfig(model=ModelConfig(path=str(vlm_dir)), output_dir=str(tmp_path / "judge"), steps=500, batch_size=32,
                    lr=1e-3, threads=1, progress=False, eval_every=500, eval_max_new_tokens=3, loggers=[],
                    accuracy_fn="gcore_rl.rewards.builtin:verdict_match",
                    data=DataConfig(task="judge_shapes", num_prompts=2000, eval_prompts=128,
                                    task_options={"size": 16, "questions": 0}))
    result = run_sft(cfg)
    assert result.eval_accuracy >= 0.9, result
    judge = JudgeRewarder.from_config(JudgeConfig(enabled=True, model_path=str(tmp_path / "judge"), max_new_tokens=3))
    rows = [r for r in attach_task_images(make_task_rows("shapes_preferences", 96, 7, size=16, questions=0))
            if r["mistake"] == "wrong"]
    right, _ = judge.score([RewardInput(r["prompt"], r["chosen"], r) for r in rows])
    wrong, _ = judge.score([RewardInput(r["prompt"], r["rejected"], r) for r in rows])
    assert all(v.parsed for v in right + wrong)
    mean = lambda verdicts: sum(v.reward for v in verdicts) / len(verdicts)  # noqa: E731
    assert mean(right) >= 0.8 and mean(wrong) <= 0.2, (mean(right), mean(wrong))
