"""A backend and a rollout function written outside `gcore_rl`, named by import path, run the demo's GRPO step
(`recipes/grpo_addition.yaml`, dynamic sampling on) through the one engine factory: in this process, and on
Ray under `colocate` (the trainer's devices generate, weights gathered into the engine) and `disaggregated`
(weights published in buckets to a rollout device)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from fake_backend import CALLS_FILE
from ray_folder import ray_importing  # noqa: I001  (tests/rollout, on the path)

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job

HERE = Path(__file__).resolve().parent
RECIPE = HERE.parents[1] / "recipes" / "grpo_addition.yaml"


@pytest.fixture
def tiny(tmp_path):
    return write_tiny_model(tmp_path / "tiny", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))


def _step(tmp_path, model: Path, *extra: str) -> dict:
    """One GRPO step of the demo's recipe (4 prompts, no held-out evaluation, a reward a random model earns) with
    the fake backend; its record."""
    out = tmp_path / "run"
    cfg = load_config(JobConfig, RECIPE, [
        f"model.path={model}", f"run.output_dir={out}", "run.steps=1", "run.prompts_per_step=4", "run.eval_every=0",
        "run.stop_at_eval_accuracy=0", "data.eval_prompts=4", "run.progress=false", "runtime.threads_per_process=1",
        "engine.backend=fake_backend:build", "reward.rules.0.fn=seam_reward:digit_share", *extra])
    run_job(cfg)
    [record] = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return record


def _trained(record: dict) -> None:
    assert record["step"] == 1 and record["sampling/generated_groups"] >= 4
    assert math.isfinite(record["pg_loss"]) and record["grad_norm"] > 0
    assert record["rollout/logprob_gap_max"] < 1e-4  # the fake backend's log-probs are the trainer's
    assert record["work/rollout/tokens"] > 0  # counted by the caller: the fake backend keeps no statistics


TWO_TURNS = ("rollout.function=tool_rollout:tool_between_turns",
             "rollout.options={first_turn_tokens: 2, second_turn_tokens: 3, tool_text: '=7'}")


def test_a_backend_and_a_rollout_function_by_import_path_train_in_process(tmp_path, tiny):
    record = _step(tmp_path, tiny, *TWO_TURNS)
    _trained(record)
    assert record["rollout/inserted_tokens"] == 2 * 4 * 8  # the tool's "=7" in each of the 32 trained samples
    assert (tiny / CALLS_FILE).read_text().count("generate") >= 2  # each wave: a turn, then a continuation


@pytest.fixture(scope="module")
def ray_with_this_folder():
    """A Ray instance whose workers import this folder's modules."""
    with ray_importing(pytest.importorskip("ray"), HERE):
        yield


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["colocate", "disaggregated"])
def test_a_backend_by_import_path_trains_on_ray(tmp_path, tiny, ray_with_this_folder, strategy):
    two_turns = TWO_TURNS if strategy == "disaggregated" else ()  # the rollout function in a Ray worker too
    record = _step(tmp_path, tiny, "runtime.kind=ray", "runtime.devices_per_controller=2",
                   f"placement.strategy={strategy}", *two_turns)
    _trained(record)
    assert ("rollout/inserted_tokens" in record) == bool(two_turns)
    calls = (tiny / CALLS_FILE).read_text()
    assert calls.count("generate") >= 1
    if strategy == "colocate":
        assert record["work/sync/loads"] == 1  # every device's engine took the new weights (a mean over the slice)
