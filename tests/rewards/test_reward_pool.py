"""Rule rewards in a pool of worker processes with a per-call time limit (`reward.workers`, `reward.timeout_s`)."""

from __future__ import annotations

import multiprocessing

import pytest

from gcore_rl.errors import ConfigError, RewardError
from gcore_rl.records import RewardInput
from gcore_rl.rewards.rule import RewardConfig, RewardFnConfig, RuleRewards

USER_REWARDS = '''
import time

def slow_on_marker(prompt, completion, **row):
    if completion == "hang":
        time.sleep(60)  # far past any timeout of these tests: only a killed worker ends it
    return float(completion.strip() == row.get("answer"))

def level(prompt, completion, answer="", level=0, **row):
    return float(level) + 0.25 * len(completion)

def fails(prompt, completion, **row):
    raise ValueError("no score")

def dies(prompt, completion, **row):
    import os
    os._exit(3)  # the worker process ends without returning
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch) -> str:
    """A user's reward file, importable (as `user_rewards`) here and in the pool's workers."""
    (tmp_path / "user_rewards.py").write_text(USER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "user_rewards"


def sample(completion: str, answer: str = "95", **extra) -> RewardInput:
    return RewardInput(prompt="37+58=", completion=completion, row={"prompt": "37+58=", "answer": answer, **extra})


def pooled(cfg: RewardConfig, workers: int = 2, timeout_s: float = 0.5, on_timeout: str = "zero") -> RewardConfig:
    cfg.workers, cfg.timeout_s, cfg.on_timeout = workers, timeout_s, on_timeout
    return cfg


def test_pooled_scores_equal_in_process_scores(user_module):
    def config() -> RewardConfig:
        return RewardConfig(rules=[RewardFnConfig(fn="gcore_rl.rewards.builtin:exact_match", weight=1.0),
                                   RewardFnConfig(fn=f"{user_module}:level", weight=0.5),
                                   RewardFnConfig(fn=f"{user_module}:fails", weight=2.0)],
                            on_error="assign", error_value=-1.0, accuracy_fn="gcore_rl.rewards.builtin:digit_accuracy")

    samples = [sample("95", level=2), sample("9"), sample(" 12 ", level=1), sample("95", answer="95")]
    with RuleRewards(config()) as in_process, RuleRewards(pooled(config(), timeout_s=30.0)) as in_pool:
        assert in_pool(samples) == in_process(samples)
        config_ok = RewardConfig(rules=[RewardFnConfig(fn=f"{user_module}:level")])
        with RuleRewards(config_ok) as a, RuleRewards(pooled(config_ok, timeout_s=30.0)) as b:
            assert b(samples) == a(samples)
    assert multiprocessing.active_children() == []  # close() stopped every worker


def test_hanging_call_scores_zero_and_is_counted_then_the_pool_goes_on(user_module):
    cfg = pooled(RewardConfig(rules=[RewardFnConfig(fn=f"{user_module}:slow_on_marker")], accuracy_fn=None))
    with RuleRewards(cfg) as rewards:
        out = rewards([sample("95"), sample("hang"), sample("12")])
        assert out.rewards == [1.0, 0.0, 0.0]
        assert out.timeout_count == 1
        assert out.error_count == 0
        again = rewards([sample("95"), sample("95")])  # the killed worker was replaced
        assert again.rewards == [1.0, 1.0] and again.timeout_count == 0
    assert multiprocessing.active_children() == []


def test_hanging_call_with_on_timeout_error_names_the_function_and_the_sample(user_module):
    cfg = pooled(RewardConfig(rules=[RewardFnConfig(fn=f"{user_module}:slow_on_marker")], accuracy_fn=None),
                 on_timeout="error")
    with RuleRewards(cfg) as rewards, pytest.raises(RewardError) as raised:
        rewards([sample("95"), sample("hang")])
    message = str(raised.value)
    assert f"{user_module}:slow_on_marker" in message and "sample 1" in message and "reward.timeout_s=0.5" in message
    assert "reward.on_timeout=zero" in message
    assert multiprocessing.active_children() == []  # the error path closed the pool too


def test_a_worker_that_dies_is_a_reward_failure_and_is_replaced(user_module):
    cfg = pooled(RewardConfig(rules=[RewardFnConfig(fn=f"{user_module}:dies")], accuracy_fn=None), timeout_s=30.0)
    with RuleRewards(cfg) as rewards:
        with pytest.raises(RewardError, match=r"dies` failed on sample 0.*worker process died \(exit code 3\)"):
            rewards([sample("95")])
        cfg.on_error, cfg.error_value = "assign", -1.0
        out = rewards([sample("95"), sample("9")])
        assert out.rewards == [-1.0, -1.0] and out.error_count == 2 and out.timeout_count == 0
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize(("key", "value", "named"), [("workers", -1, "workers"), ("timeout_s", 0.0, "timeout_s"),
                                                     ("on_timeout", "skip", "on_timeout")])
def test_bad_pool_settings_name_the_key(key, value, named):
    cfg = RewardConfig()
    setattr(cfg, key, value)
    with pytest.raises(ConfigError) as raised:
        cfg.validate()
    assert raised.value.key == named
