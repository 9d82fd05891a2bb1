"""Model reward kinds behind a registry: a third kind, registered by a test, runs a step like the built-in two."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gcore_rl.config import JobConfig, frozen_model_paths, model_reward_weights, plan_roles
from gcore_rl.configlib import load_config
from gcore_rl.errors import ConfigError
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import Verdict
from gcore_rl.rewards.kinds import RewardKind, register_reward_kind, reward_kinds, unregister_reward_kind
from gcore_rl.runtime.driver import run_job

SETTINGS = SimpleNamespace(enabled=True, weight=0.5, model_path=None)
"""The fake kind's settings (a kind of a plugin would read a section of its own config)."""


class _Resident:
    """What sleeps and wakes on a time-shared device: here, nothing but the state the worker reads."""

    state = "awake"

    def sleep(self, level: str) -> int:
        self.state = "offloaded"
        return 0

    def wake(self) -> None:
        self.state = "awake"


class LengthScorer:
    """Scores a completion by its length in characters, a tenth per character."""

    engine = None
    pad_id = None

    def __init__(self, seen: list):
        self.resident = _Resident()
        self.seen = seen

    def score(self, samples):
        self.seen.extend(s.completion for s in samples)
        return [Verdict.of_score(len(s.completion) / 10) for s in samples]

    def take_stats(self):
        return None


@pytest.fixture
def length_kind():
    calls = {"checked": 0, "built": [], "scored": []}

    def check(cfg):
        calls["checked"] += 1

    def build(cfg, device, seed):
        calls["built"].append(seed)
        return LengthScorer(calls["scored"])

    register_reward_kind(RewardKind(name="length_prior", section=lambda cfg: SETTINGS, build=build, check=check))
    yield calls
    unregister_reward_kind("length_prior")


def test_the_builtin_kinds_come_first_and_a_name_is_registered_once(length_kind):
    assert list(reward_kinds()) == ["judge", "reward_model", "length_prior"]
    assert reward_kinds()["judge"].generates and not reward_kinds()["reward_model"].generates
    with pytest.raises(ValueError, match="'judge' is registered already"):
        register_reward_kind(RewardKind(name="judge", section=lambda cfg: SETTINGS, build=None, check=None))


def _cfg(tmp_path, *extra: str) -> JobConfig:
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    return load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.prompts_per_step=4",
        "sampling.n=2", "sampling.max_new_tokens=4", "data.eval_prompts=0", "run.progress=false",
        "runtime.threads_per_process=1", "reward.rules.0.weight=0.0", *extra,
    ])


def test_a_registered_kind_is_a_role_a_weight_and_a_reward_in_every_step(tmp_path, length_kind):
    cfg = _cfg(tmp_path, "placement.min_devices={length_prior: 1}")  # its name is a role the config knows
    assert plan_roles(cfg) == ["actor", "rollout", "length_prior"]
    assert model_reward_weights(cfg) == {"length_prior": 0.5} and frozen_model_paths(cfg) == {}
    run_job(cfg)
    assert length_kind["checked"] == 1 and length_kind["built"] == [cfg.run.seed]
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    scored = length_kind["scored"]
    assert len(scored) == 2 * 4 * 2  # every sample of both steps, once
    for step, line in enumerate(lines):
        lengths = [len(text) / 10 for text in scored[step * 8:(step + 1) * 8]]
        assert line["length_prior/mean_score"] == pytest.approx(sum(lengths) / 8, abs=1e-6)
        assert line["reward/mean"] == pytest.approx(0.5 * line["length_prior/mean_score"], abs=1e-6)
        assert "length_prior/unparsed" not in line  # it generates nothing, so nothing can fail to parse
        assert line["util/length_prior/busy_s"] > 0
    events = [json.loads(x) for x in (tmp_path / "run" / "timeline" / "device-0.jsonl").read_text().splitlines()]
    assert "length_prior" in {e["role"] for e in events}


def test_a_role_no_kind_names_is_refused_in_min_devices(tmp_path):
    with pytest.raises(ConfigError) as info:
        _cfg(tmp_path, "placement.min_devices={length_prior: 1}")
    assert info.value.key == "placement.min_devices.length_prior" and "reward_model" in info.value.message
