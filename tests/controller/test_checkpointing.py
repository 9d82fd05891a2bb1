"""A controller's checkpoint state survives JSON exactly: rollouts in flight (completions, engine log-probs,
policy versions, rewards, mask), the rebalancer's history, and the refusal of a file that is not one; a state
written before bounded staleness (one rollout ahead, or none) still reads."""

from __future__ import annotations

import json

import pytest
import torch

from gcore_rl.algos.dynamic_sampling import Group, StepBatch
from gcore_rl.controller.checkpointing import ControllerState, decode_rollout, encode_rollout
from gcore_rl.controller.program import GroupPayload, StepRollout
from gcore_rl.errors import CheckpointError
from gcore_rl.placement.rebalance import RolloutLoad
from gcore_rl.records import Completion


def _rollout() -> StepRollout:
    # float32 log-probs as the engine reports them (`tolist()` of a float32 tensor), and awkward floats
    completions = [Completion(prompt_index=i, prompt_ids=[5, 6 + i], token_ids=[7, 8, 9][: i + 1],
                              logprobs=[-0.1234567890123, -1e-30, -17.5][: i + 1], finish_reason="length" if i else "stop",
                              policy_version=3, sample_index=i % 2) for i in range(3)]
    groups = [Group(key=0, rewards=(0.0, 1.0 / 3.0), payload=GroupPayload(row_id=41, completions=completions[:2])),
              Group(key=1, rewards=(0.5, 0.5), payload=GroupPayload(row_id=7, completions=completions[2:]))]
    batch = StepBatch(groups=groups, mask=[True, False], waves=2, generated_groups=5, valid_fraction_observed=0.4)
    return StepRollout(groups=batch, stats={"reward/mean": 0.1 + 0.2, "sampling/waves": 2.0}, row_ids=[41, 7, 3])


def test_a_rollout_in_flight_round_trips_through_json_exactly():
    rollout = _rollout()
    decoded = decode_rollout(json.loads(json.dumps(encode_rollout(rollout))))
    assert decoded == rollout  # dataclass equality: every completion, float and flag


def test_controller_state_round_trips_and_restores_the_rebalancer_history(tmp_path):
    loads = [RolloutLoad(generate_s=1.25, score_s=0.5, swap_s=0.1, generate_fixed_s=0.2, phase_s=2.0, rollout_devices=2)]
    state = ControllerState(step=6, controllers=2, sampler={"epoch": 1, "position": 3}, epoch=1, drawn_rows=[4, 9],
                            waves={"version": 1, "ema": 0.7, "buffer": []}, loads=[load.as_dict() for load in loads],
                            rollout_devices=2, plan_version=5, ahead=[encode_rollout(_rollout())] * 2, rewards=[0.1, 0.2],
                            eval_before={"eval/accuracy": 0.25}, eval_after={})
    path = tmp_path / "controller-0.json"
    state.write(path)
    read = ControllerState.read(path)
    assert read == state
    assert read.rollout_loads() == loads
    assert [decode_rollout(entry) for entry in read.rollouts_ahead()] == [_rollout(), _rollout()]


def test_a_states_tensors_go_beside_its_json_and_come_back(tmp_path):
    """A diffusion sample's trajectory is too large for JSON: the state's `tensors` go to controller-<k>.safetensors."""
    tensors = {"g0.latents": torch.randn(2, 3, 4), "g0.times": torch.linspace(1, 0, 3)}
    state = ControllerState(step=1, controllers=1, sampler={}, epoch=0, drawn_rows=[], waves={}, loads=[],
                            rollout_devices=1, plan_version=0, ahead=[], rewards=[0.5], eval_before={}, eval_after={},
                            tensors=tensors)
    path = tmp_path / "controller-0.json"
    state.write(path)
    assert "g0.latents" not in path.read_text() and path.with_suffix(".safetensors").is_file()
    read = ControllerState.read(path)
    assert read.tensors.keys() == tensors.keys() and all(torch.equal(read.tensors[k], tensors[k]) for k in tensors)


def test_a_state_from_before_the_shared_loop_reads_its_accuracies_as_evaluations(tmp_path):
    path = tmp_path / "controller-0.json"
    ControllerState(step=1, controllers=1, sampler={}, epoch=0, drawn_rows=[], waves={}, loads=[], rollout_devices=1,
                    plan_version=0, ahead=[], rewards=[0.5], eval_before={}, eval_after={}).write(path)
    entry = json.loads(path.read_text())
    del entry["eval_before"], entry["eval_after"]
    path.write_text(json.dumps({**entry, "eval_accuracy_before": 0.25, "eval_accuracy_after": None}))
    read = ControllerState.read(path)
    assert read.eval_before == {"eval/accuracy": 0.25} and read.eval_after == {}


@pytest.mark.parametrize("ahead, count", [(None, 0), ("one", 1)])
def test_a_state_from_before_bounded_staleness_reads_as_a_queue(tmp_path, ahead, count):
    # one-step-off checkpoints held the rollout ahead as one object (or null), not a list
    state = ControllerState(step=2, controllers=1, sampler={}, epoch=0, drawn_rows=[], waves={}, loads=[],
                            rollout_devices=1, plan_version=0, ahead=encode_rollout(_rollout()) if ahead else None,
                            rewards=[0.5], eval_before={}, eval_after={})
    path = tmp_path / "controller-0.json"
    state.write(path)
    assert [decode_rollout(entry) for entry in ControllerState.read(path).rollouts_ahead()] == [_rollout()] * count


@pytest.mark.parametrize("content, says", [("{not json", "not a controller state"),
                                           ('{"step": 1}', "not a controller state")])
def test_a_file_that_is_not_a_controller_state_is_named(tmp_path, content, says):
    path = tmp_path / "controller-0.json"
    path.write_text(content)
    with pytest.raises(CheckpointError, match=says) as raised:
        ControllerState.read(path)
    assert str(path) in str(raised.value)
    with pytest.raises(CheckpointError, match="is missing"):
        ControllerState.read(tmp_path / "controller-1.json")
