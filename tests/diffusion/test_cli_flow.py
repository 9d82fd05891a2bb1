"""The diffusion policy through the command line: init-tiny-diffusion → flow-matching SFT → Flow-GRPO."""

import json

import pytest
from cli_helpers import REPO, gcore_rl

from gcore_rl.models.flow import load_flow_model


def test_the_three_commands_write_a_model_grids_and_metrics(tmp_path):
    proc = gcore_rl("init-tiny-diffusion", "base", "resolution=8", "num_layers=1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    proc = gcore_rl("sft", REPO / "recipes/flow_sft_shapes.yaml", "model_path=base", "output_dir=sft", "resolution=8",
                    "max_steps=20", "target_loss=0", "eval_every=10", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "sft done: 20 steps" in proc.stdout and (tmp_path / "sft/samples.png").is_file()
    proc = gcore_rl("train", REPO / "recipes/flow_grpo_shapes.yaml", "model.path=sft", "run.output_dir=grpo", "run.steps=3",
                    "run.eval_every=2", "run.prompts_per_step=2", "sampling.n=3", "sampling.resolution=8",
                    "run.progress=false", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "done: 3 steps" in proc.stdout
    run = tmp_path / "grpo"
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert {"reward/mean", "pg_loss", "clip_fraction", "throughput/images_per_s"} <= lines[0].keys()
    assert "eval/reward" in lines[1] and "eval/reward" not in lines[0]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["eval_reward_after"] == lines[2]["eval/reward"]
    for grid in ("grid_before.png", "grid_after.png"):
        assert (run / grid).stat().st_size > 0
    assert load_flow_model(run / "final").arch == "sd3"


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_diffusion_demo_learns_with_every_parameter_and_with_lora(tmp_path, seed):
    """Issue 19's criterion: the mean reward of the last 10 steps is at least the first 10 steps' + 0.2; issue 46's:
    LoRA adapters (`flow_demo_seeds.LORA`) from the same warm start rise as the full-parameter run does."""
    from flow_demo_seeds import LORA, run_demo

    for result in run_demo(tmp_path, seed=seed, threads=1, arms={"full": (), "lora": LORA}):
        assert result["last_rewards"] >= result["first_rewards"] + 0.2, result
