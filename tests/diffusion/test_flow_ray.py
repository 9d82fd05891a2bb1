"""A diffusion policy under the placement strategies on Ray: partial (the image reward model on a device of its
own scores chunks while the others are still sampled) and disaggregated (sampling apart from the trainers, which
publish weights), with 2 controllers whose trainers form one FSDP2 group."""

from __future__ import annotations

import json

import pytest
from cli_helpers import REPO

from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.errors import ConfigError
from gcore_rl.models.flow import load_flow_model
from gcore_rl.runtime.driver import run_job

RECIPE = REPO / "recipes" / "flow_grpo_shapes.yaml"


def _job(tmp_path, models, *overrides):
    return load_config(FlowGrpoJobConfig, RECIPE, [
        f"model.path={models['policy']}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.eval_every=2",
        "run.progress=false", "run.stop_at_eval_reward=0", "data.eval_prompts=2", "sampling.eval_steps=4",
        "sampling.steps=4", "sampling.resolution=8", "sampling.n=2",
        "sampling.batch_size=2", "runtime.kind=ray", "runtime.threads_per_process=1", *overrides])


def _check_run(tmp_path):
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    assert load_flow_model(tmp_path / "run" / "final").arch == "sd3"
    return lines


@pytest.mark.slow
def test_partial_scores_images_on_their_own_device_while_sampling_goes_on(ray_instance, tmp_path, models):
    """Device 0 samples (4 prompts × 2 images in chunks of 2: 4 calls a step, each made 1 s longer), device 1 holds
    the reward model; a chunk is scored as soon as it is sampled, so scoring starts before the step's last chunk is
    done (the margin: the 3 s the other chunks take at least)."""
    summary = run_job(_job(tmp_path, models, "placement.strategy=partial", "runtime.devices_per_controller=2",
                                "run.prompts_per_step=4", f"reward_model.model_path={models['rm']}",
                                "sampling.added_seconds_per_chunk=1.0"))
    assert summary.steps == 2
    lines = _check_run(tmp_path)
    assert "reward_model/mean_score" in lines[0]
    events = {d: [json.loads(line) for line in (tmp_path / "run" / "timeline" / f"device-{d}.jsonl").read_text().splitlines()]
              for d in (0, 1)}
    assert {e["what"] for e in events[0]} >= {"rollout/generate", "update/train"}
    assert {e["what"] for e in events[1]} >= {"rollout/reward_model", "update/train"}
    samples = [e for e in events[0] if e["what"] == "rollout/generate"]
    scores = [e for e in events[1] if e["what"] == "rollout/reward_model"]
    # the first training step's 4 sample calls come after the evaluation's 4 (2 prompts × 4 images, chunks of 2)
    step_samples, step_scores = samples[4:8], scores[4:8]
    assert step_scores[0]["start"] < step_samples[-1]["end"]


@pytest.mark.slow
def test_disaggregated_two_controllers_sample_one_step_ahead_and_publish_weights(ray_instance, tmp_path, models):
    summary = run_job(_job(tmp_path, models, "placement.strategy=disaggregated", "runtime.controllers=2",
                                "runtime.devices_per_controller=2", "run.prompts_per_step=4"))
    assert summary.steps == 2
    lines = _check_run(tmp_path)
    # step 2's images were sampled while step 1 trained, on the weights before it: one step off-policy
    assert lines[0]["rollout/staleness_max"] == 0 and lines[1]["rollout/staleness_max"] == 1


def test_strategies_that_split_a_slice_need_ray(tmp_path, models):
    with pytest.raises(ConfigError, match="placement.strategy.*runtime.kind=ray"):
        load_config(FlowGrpoJobConfig, RECIPE, [f"model.path={models['policy']}", "placement.strategy=partial",
                                                f"reward_model.model_path={models['rm']}"])
