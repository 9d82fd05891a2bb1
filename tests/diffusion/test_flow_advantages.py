"""A diffusion job's advantages come from the shared estimator registry (`algo.advantage`), as a language job's do."""

from __future__ import annotations

import json
import typing

import pytest
import torch
from cli_helpers import REPO

from gcore_rl.algos.advantages import group_advantages, rloo_advantages
from gcore_rl.algos.registry import ADVANTAGES
from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowAlgoConfig, FlowGrpoJobConfig
from gcore_rl.diffusion.samples import image_advantages
from gcore_rl.errors import ConfigError
from gcore_rl.runtime.driver import run_job

RECIPE = REPO / "recipes" / "flow_grpo_shapes.yaml"
REWARDS = torch.tensor([0.1, 0.5, -0.2, 0.3, 0.3, 0.3, 1.0, 0.0])  # 4 groups of 2; the third has no signal


def test_each_estimator_is_the_registrys_on_the_images_rewards():
    assert torch.equal(image_advantages("grpo", REWARDS, 2), group_advantages(REWARDS, 2))
    assert torch.equal(image_advantages("dr_grpo", REWARDS, 2), group_advantages(REWARDS, 2, scale_by_std=False))
    assert torch.equal(image_advantages("rloo", REWARDS, 2), rloo_advantages(REWARDS, 2))
    whitened = image_advantages("reinforce_pp", REWARDS, 2)  # one "token" per image: the rewards, whitened
    assert whitened.shape == (8,) and abs(float(whitened.mean())) < 1e-6
    assert image_advantages("grpo", REWARDS, 2)[4:6].abs().max() == 0  # a constant group gives nothing


def test_the_choices_are_the_registrys_estimators_that_need_only_rewards():
    names = typing.get_args(typing.get_type_hints(FlowAlgoConfig)["advantage"])
    assert set(names) == {name for name, spec in ADVANTAGES.items() if not spec.needs and not spec.on_trainer}


def test_estimators_a_diffusion_job_cannot_feed_are_refused(models):
    base = [f"model.path={models['policy']}"]
    with pytest.raises(ConfigError, match="algo.advantage"):
        load_config(FlowGrpoJobConfig, RECIPE, [*base, "algo.advantage=gae"])
    with pytest.raises(ConfigError, match="algo.advantage.*whitens"):
        load_config(FlowGrpoJobConfig, RECIPE, [*base, "algo.advantage=reinforce_pp", "runtime.controllers=2"])


def test_a_diffusion_job_trains_with_rloo(tmp_path, models):
    cfg = load_config(FlowGrpoJobConfig, RECIPE, [
        f"model.path={models['policy']}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.eval_every=2",
        "run.progress=false", "run.stop_at_eval_reward=0", "run.save_final=false", "data.eval_prompts=1",
        "sampling.eval_steps=2", "sampling.steps=2", "sampling.resolution=8", "sampling.n=2", "run.prompts_per_step=4",
        "runtime.threads_per_process=1", "algo.advantage=rloo"])
    assert run_job(cfg).steps == 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(torch.isfinite(torch.tensor(line["pg_loss"])) for line in lines)
