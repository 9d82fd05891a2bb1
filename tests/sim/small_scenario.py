"""A small scenario the simulator tests build on (runs in milliseconds).

A module of its own rather than the conftest, so that a test can import it by a name no other
test directory uses (`from conftest import ...` picks whichever conftest pytest imported first).
"""

from __future__ import annotations

from gcore_rl.configlib import apply_overrides, from_dict
from gcore_rl.sim.scenario import Scenario

SMALL = {
    "name": "small",
    "gpus": 8,
    "controllers": 2,
    "steps": 3,
    "hardware": {"preset": "H100"},
    "models": {"policy": {"preset": "Qwen2.5-0.5B"}, "judge": {"preset": "Qwen2.5-0.5B"}, "reference": True},
    "workload": {
        "prompts_per_step": 16,
        "group_size": 4,
        "prompt_tokens": {"median": 64, "sigma": 0.2, "max": 256},
        "response_tokens": {"median": 128, "sigma": 0.8, "max": 1024},
        "judge_template_tokens": 32,
        "judge_output_tokens": {"median": 64, "sigma": 0.3, "max": 256},
        "valid_fraction": {"start": 0.8, "end": 0.5},
        "dynamic_sampling": {"enabled": True},
    },
    "placement": {"rollout_devices": 2, "train_devices": 2},
}


def make_scenario(*overrides: str) -> Scenario:
    """The small scenario with dotted overrides applied (as on the command line)."""
    return from_dict(Scenario, apply_overrides(SMALL, list(overrides), schema=Scenario))
