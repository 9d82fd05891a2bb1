"""A Flow-GRPO job on CUDA (the local runtime: controller k on CUDA device k): the image engine, the trainer and the
image reward model on the GPU, trajectories on the host. Skipped where there is no CUDA device (CI); run on a GPU
machine with `pytest tests/diffusion/test_flow_cuda.py`."""

from __future__ import annotations

import json
import math

import pytest
import torch
from cli_helpers import REPO

from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowGrpoJobConfig
from gcore_rl.models.flow import load_flow_model
from gcore_rl.runtime.driver import run_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_a_flow_grpo_job_trains_on_cuda(tmp_path, models):
    run = tmp_path / "run"
    cfg = load_config(FlowGrpoJobConfig, REPO / "recipes" / "flow_grpo_shapes.yaml", [
        f"model.path={models['policy']}", f"reward_model.model_path={models['rm']}", f"run.output_dir={run}",
        "run.steps=3", "run.eval_every=3", "run.progress=false", "run.stop_at_eval_reward=0", "data.eval_prompts=2",
        "sampling.resolution=8", "sampling.steps=4", "sampling.eval_steps=4", "sampling.n=2", "sampling.batch_size=4",
        "run.prompts_per_step=4", "train.kl_coef=0.04", "runtime.device=cuda"])
    assert run_job(cfg).steps == 3
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = lines
    assert all(math.isfinite(line["pg_loss"]) and math.isfinite(line["reward_model/mean_score"]) for line in steps)
    # before its first optimiser step the trainer recomputes the engine's step log-probs (fp32 on the GPU both)
    assert max(line["rollout/logprob_gap_max"] for line in steps) < 1e-4
    assert steps[-1]["kl"] > 0  # the reference moved apart from the policy
    assert load_flow_model(run / "final").arch == "sd3"


def test_the_image_engine_replays_its_denoising_steps_as_cuda_graphs(models):
    """Issue 49 on a GPU: the default engine captures each batch's denoising step and replays it (graphs recorded,
    not fallen back), with the eager engine's images and step log-probs to fp32 round-off."""
    import copy

    from gcore_rl.rollout.flow_sampler import FlowSampler, ImageSamplingConfig

    model = load_flow_model(models["policy"])
    graphs = FlowSampler(model, copy.deepcopy(model.transformer), "cuda")
    eager = FlowSampler(model, copy.deepcopy(model.transformer), "cuda", cuda_graphs=False)
    assert graphs.static_shapes and not eager.static_shapes
    cfg = ImageSamplingConfig(n=2, steps=6, resolution=8, guidance=3.0, batch_size=4)
    prompts = ["a red circle", "a blue square"] * 4
    for seed in (0, 1):
        first, second = eager.sample(prompts, cfg, seed=seed), graphs.sample(prompts, cfg, seed=seed)
        assert torch.allclose(first.latents, second.latents, atol=1e-5, rtol=0)
        assert torch.allclose(first.logprobs, second.logprobs, atol=1e-5, rtol=0)
    assert all(replay.graph is not None for replay in graphs._replays.values())
