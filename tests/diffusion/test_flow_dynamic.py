"""Dynamic placement of a diffusion job: the chunk model of a rollout phase, the rebalancer's decisions from counted
work, and (on Ray) a slice whose split follows an injected slow side."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from cli_helpers import REPO

from gcore_rl.configlib import load_config
from gcore_rl.diffusion.config import FlowGrpoJobConfig, flow_plan
from gcore_rl.diffusion.forecast import ChunkForecaster, ImageWork, forecast, phase_seconds
from gcore_rl.errors import ConfigError
from gcore_rl.placement.rebalance import RebalanceConfig, RolloutLoad, rebalance
from gcore_rl.runtime.driver import run_job

RECIPE = REPO / "recipes" / "flow_grpo_shapes.yaml"


def test_phase_seconds_follows_chunks_through_sampling_and_scoring():
    # one device each: 4 chunks done at 1, 2, 3, 4 s; the last is scored after the sampling: 4.5 s
    assert phase_seconds(4, 1, 1, 1.0, 0.5) == 4.5
    # scoring slower than sampling queues up: chunks done at 1, 1, 2, 2 s on 2 devices, 2 scorers of 3 s each
    # take chunks 0, 2 and 1, 3: 1 + 3 = 4, then 4 + 3 = 7
    assert phase_seconds(4, 2, 2, 1.0, 3.0) == 7.0
    # 5 chunks on 2 devices: a third round for one device (done at 3 s); scoring 0.1 s ends at 3.1 s
    assert phase_seconds(5, 2, 3, 1.0, 0.1) == pytest.approx(3.1)
    assert phase_seconds(3, 2, 0, 1.0, 9.0) == 2.0  # no scorers: the sampling alone
    assert phase_seconds(0, 2, 2, 1.0, 1.0) == 0.0
    # every split of a slice of 4: entry r - 1 for r rollout devices
    assert forecast(4, 4, 1.0, 0.5) == (phase_seconds(4, 1, 3, 1.0, 0.5), phase_seconds(4, 2, 2, 1.0, 0.5),
                                        phase_seconds(4, 3, 1, 1.0, 0.5))


@pytest.mark.parametrize(("sample_s", "score_s", "start", "expected"), [
    (1.0, 0.05, 1, 3),    # sampling is the work: toward 3 of 4 devices sampling (max_units 2 reaches it)
    (0.05, 1.0, 3, 1),    # scoring is the work: toward 1 sampling device, 3 scoring
    (1.0, 1.0, 2, 2),     # balanced: the 2 + 2 split is the best, it stays
])
def test_the_split_moves_toward_the_slow_side_and_stays_when_balanced(sample_s, score_s, start, expected):
    """8 chunks, each sampled in `sample_s` and scored in `score_s`: the chunk forecast priced at every split, fed to the
    shared rebalancer as `rebalance_split` feeds it."""
    forecaster = ChunkForecaster(slice_devices=4)
    measured = RolloutLoad(generate_s=sample_s * 8, score_s=score_s * 8, generate_busy_s=sample_s * 8,
                           score_busy_s=score_s * 8, rollout_devices=start)
    forecasts = forecaster.forecast([ImageWork(chunks=5, scored=True), ImageWork(chunks=3, scored=True)], measured)
    assert forecaster.vector(forecasts) == forecast(8, 4, sample_s, score_s)
    load = replace(measured, forecast=forecaster.vector(forecasts), phase_s=forecast(8, 4, sample_s, score_s)[start - 1])
    decision = rebalance([load], start, 4, RebalanceConfig())
    assert decision.rollout_devices == expected
    assert decision.predicted_s <= decision.current_s


def _events(run, device: int) -> list[dict]:
    path = run / "timeline" / f"device-{device}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
@pytest.mark.parametrize(("slow", "start", "moved_to"), [
    ("sampling.added_seconds_per_chunk=0.5", 1, 2),  # 4 chunks of 0.5 s on one device: 2 sampling devices halve it
    # 0.5 s per chunk scored on one device: 2 scorers halve it (3 would take as long: one of them scores 2 chunks)
    ("reward_model.added_seconds_per_image=0.25", 3, 2),
])
def test_a_dynamic_slice_moves_devices_to_the_side_whose_work_is_slow(ray_instance, tmp_path, models, slow, start,
                                                                      moved_to):
    """One controller, 4 devices on Ray, 4 chunks of 2 images a step; an injected delay makes one side slow. After
    step 1 the split moves (placement metrics), and step 2's chunks go where the new plan says (device timelines).
    The margins: the injected 0.5 s per chunk against the tiny models' milliseconds."""
    run = tmp_path / "run"
    cfg = load_config(FlowGrpoJobConfig, RECIPE, [
        f"model.path={models['policy']}", f"run.output_dir={run}", "run.steps=2", "run.eval_every=100",
        "run.progress=false", "run.stop_at_eval_reward=0", "data.eval_prompts=1", "sampling.eval_steps=2",
        "sampling.steps=2", "sampling.resolution=8", "sampling.n=2", "sampling.batch_size=2", "run.prompts_per_step=4",
        "runtime.kind=ray", "runtime.threads_per_process=1", "runtime.devices_per_controller=4",
        "placement.strategy=dynamic", f"placement.rollout_devices={start}", f"reward_model.model_path={models['rm']}",
        slow])
    assert run_job(cfg).steps == 2
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [line.get("placement/rollout_devices") for line in lines] == [start, moved_to]
    assert lines[0]["placement/next_rollout_devices"] == moved_to
    assert lines[0]["placement/next_predicted_rollout_s"] < 0.8 * lines[0]["placement/predicted_rollout_s"]
    # step 2 sampled on the first `moved_to` devices: each device's timeline labels its sampling calls by step; step
    # 2's are its 4 chunks, then 2 for its evaluation (1 prompt x 4 images), as step 0's 2 before step 1
    samples = sorted((event for device in range(4) for event in _events(run, device) if event["what"] == "rollout/generate"),
                     key=lambda event: event["start"])
    assert [sum(event["step"] == step for event in samples) for step in (0, 1, 2)] == [2, 4, 6]
    assert {event["device"] for event in samples if event["step"] == 1} == set(range(start))
    assert {event["device"] for event in [e for e in samples if e["step"] == 2][:4]} == set(range(moved_to))


def test_dynamic_needs_a_model_that_scores_images_and_three_devices(tmp_path, models):
    base = [f"model.path={models['policy']}", "runtime.kind=ray", "placement.strategy=dynamic"]
    with pytest.raises(ConfigError, match="reward_model.model_path nor judge.model_path"):
        load_config(FlowGrpoJobConfig, RECIPE, [*base, "runtime.devices_per_controller=4"])
    cfg = load_config(FlowGrpoJobConfig, RECIPE, [*base, "runtime.devices_per_controller=2",
                                                  f"reward_model.model_path={models['rm']}"])
    with pytest.raises(ConfigError, match="at least 3 devices per slice"):
        flow_plan(cfg)
