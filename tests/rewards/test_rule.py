import math

import pytest

from gcore_rl.configlib import load_callable
from gcore_rl.errors import ConfigError, RewardError
from gcore_rl.records import RewardInput
from gcore_rl.rewards.builtin import digit_accuracy, exact_match, verdict_match
from gcore_rl.rewards.rule import RewardConfig, RewardFnConfig, RuleRewards

HERE = __name__


def always_raises(prompt, completion, **row):
    raise RuntimeError("boom")


def returns_nan(prompt, completion, **row):
    return math.nan


def returns_text(prompt, completion, **row):
    return "1.0"


def uses_extra_column(prompt, completion, answer="", level=0, **row):
    assert "prompt" not in row
    return float(level)


def sample(completion, answer="95", prompt="37+58=", **extra):
    return RewardInput(prompt=prompt, completion=completion, row={"prompt": prompt, "answer": answer, **extra})


def test_builtin_values():
    assert exact_match("1+1=", " 2\n", answer="2") == 1.0
    assert exact_match("1+1=", "3", answer="2", task="addition") == 0.0
    assert digit_accuracy("p", "95", answer="95") == 1.0
    assert digit_accuracy("p", "9", answer="95") == 0.5
    assert digit_accuracy("p", "957", answer="95") == pytest.approx(2 / 3)
    assert digit_accuracy("p", "59", answer="95") == 0.0
    assert digit_accuracy("p", "", answer="") == 1.0
    assert verdict_match("Q:1+1= A:2 score:", " 10", verdict="10") == 1.0
    assert verdict_match("p", "0 =59", verdict="0", answer="0 =59") == 1.0  # the correction does not count
    assert verdict_match("p", "10", verdict="0") == verdict_match("p", "", verdict="0") == 0.0


def test_weighted_sum_per_fn_and_accuracy():
    cfg = RewardConfig(rules=[
        RewardFnConfig(fn="gcore_rl.rewards.builtin:exact_match", weight=1.0),
        RewardFnConfig(fn="gcore_rl.rewards.builtin:digit_accuracy", weight=0.5),
    ])
    out = RuleRewards(cfg)([sample("95"), sample("9"), sample("12")])
    assert out.rewards == [1.5, 0.25, 0.0]
    assert out.accuracy == [1.0, 0.0, 0.0]
    assert out.per_fn == {
        "gcore_rl.rewards.builtin:exact_match": [1.0, 0.0, 0.0],
        "gcore_rl.rewards.builtin:digit_accuracy": [1.0, 0.5, 0.0],
    }
    assert out.error_count == 0


def test_extra_columns_are_passed_as_keywords():
    cfg = RewardConfig(rules=[RewardFnConfig(fn=f"{HERE}:uses_extra_column")], accuracy_fn=None)
    out = RuleRewards(cfg)([sample("x", level=3), sample("y", level=0)])
    assert out.rewards == [3.0, 0.0]
    assert out.accuracy is None


def test_raise_names_function_sample_and_cause():
    cfg = RewardConfig(rules=[RewardFnConfig(fn=f"{HERE}:always_raises")])
    long_completion = "z" * 500
    with pytest.raises(RewardError) as info:
        RuleRewards(cfg)([sample("95"), sample(long_completion, prompt="7+7=")])
    message = str(info.value)
    assert f"{HERE}:always_raises" in message
    assert "sample 0" in message
    assert "37+58=" in message and "boom" in message and "RuntimeError" in message
    assert "z" * 201 not in message


def test_assign_counts_errors():
    cfg = RewardConfig(
        rules=[
            RewardFnConfig(fn="gcore_rl.rewards.builtin:exact_match"),
            RewardFnConfig(fn=f"{HERE}:always_raises", weight=2.0),
        ],
        on_error="assign",
        error_value=-1.0,
    )
    out = RuleRewards(cfg)([sample("95"), sample("1")])
    assert out.rewards == [-1.0, -1.0]
    assert out.error_count == 2
    assert out.accuracy == [1.0, 0.0]


@pytest.mark.parametrize("fn_name", ["returns_nan", "returns_text"])
def test_nan_and_non_numbers_are_caught(fn_name):
    path = f"{HERE}:{fn_name}"
    with pytest.raises(RewardError, match=fn_name):
        RuleRewards(RewardConfig(rules=[RewardFnConfig(fn=path)]))([sample("95")])
    out = RuleRewards(RewardConfig(rules=[RewardFnConfig(fn=path)], on_error="assign", error_value=0.25))(
        [sample("95"), sample("95")]
    )
    assert out.rewards == [0.25, 0.25]
    assert out.error_count == 2


def test_bad_import_paths_raise_config_error_with_key():
    with pytest.raises(ConfigError) as info:
        load_callable("no_colon_here", "rules.0.fn")
    assert info.value.key == "rules.0.fn"
    with pytest.raises(ConfigError, match="not found"):
        load_callable("gcore_rl.no_such_module:fn", "k")
    with pytest.raises(ConfigError, match="no attribute"):
        load_callable("gcore_rl.rewards.builtin:nope", "k")
    with pytest.raises(ConfigError, match="not callable"):
        load_callable(f"{HERE}:HERE", "k")
    cfg = RewardConfig(rules=[RewardFnConfig(), RewardFnConfig(fn="gcore_rl.rewards.builtin:missing")])
    with pytest.raises(ConfigError) as info:
        RuleRewards(cfg)
    assert info.value.key == "rules.1.fn"
    with pytest.raises(ConfigError) as info:
        RewardConfig(rules=[RewardFnConfig(fn="a:b:c")]).validate()
    assert info.value.key == "rules.0.fn"
    RewardConfig(rules=[]).validate()  # no rules: the job must have another reward (config.JobConfig checks it)
    assert RuleRewards(RewardConfig(rules=[], accuracy_fn=None))([]).rewards == []
