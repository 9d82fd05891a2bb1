"""`tool_turns` on Ray under `colocate`, `partial` with a generative judge grading the final answers, and
`disaggregated`: the tools run in a pool inside the rollout device's Ray worker, and their answers go back into
the trajectories (a parser that reads a call into every turn makes a random policy use its tool)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ray_folder import ray_importing
from tool_template import TOOL_TEMPLATE

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job

ray = pytest.importorskip("ray")
HERE = Path(__file__).resolve().parent


@pytest.fixture
def ray_with_this_folder():
    with ray_importing(ray, HERE):
        yield


STRATEGIES = {
    "colocate": ["runtime.devices_per_controller=1", "placement.strategy=colocate"],
    "partial-with-a-judge": ["runtime.devices_per_controller=2", "placement.strategy=partial", "judge.enabled=true",
                             "judge.model_path={model}", "judge.weight=0.5"],
    "disaggregated": ["runtime.devices_per_controller=2", "placement.strategy=disaggregated"],
}


@pytest.mark.slow  # ~100 s each on 2 busy cores: a Ray instance, and a tool pool started inside a Ray worker
@pytest.mark.parametrize("strategy", sorted(STRATEGIES))
def test_tools_run_in_the_rollout_devices_pool_on_ray(strategy, tmp_path, ray_with_this_folder):
    model = write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    cfg = load_config(JobConfig, HERE.parents[1] / "recipes" / "grpo_addition.yaml", [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=1", "run.prompts_per_step=4",
        "run.eval_every=0", "run.stop_at_eval_accuracy=0", "data.eval_prompts=4", "run.progress=false",
        "sampling.max_new_tokens=48", "runtime.kind=ray", "runtime.threads_per_process=1",
        *(option.format(model=model) for option in STRATEGIES[strategy]),
        "rollout.function=gcore_rl.agents.tool_turns:tool_turns",
        "rollout.options={tools: [calc_tools:mul], parser: 'every_turn_calls:parse', max_turns: 2}",
        f"data.chat_template={json.dumps(TOOL_TEMPLATE)}"])
    run_job(cfg)
    [record] = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert record["rollout/tool_calls"] > 0 and record["rollout/tool_errors"] == 0  # answered by the pool
    assert record["rollout/turns"] > 1 and record["rollout/inserted_tokens"] > 0
    assert record["rollout/logprob_gap_max"] < 1e-4  # the policy's tokens across turns match the trainer's
    if cfg.judge.enabled:  # the judge graded the trajectories' final answers (a random judge: parsed or not)
        assert "judge/mean_score" in record and 0.0 <= record["judge/unparsed"] <= record["reward/count"]
