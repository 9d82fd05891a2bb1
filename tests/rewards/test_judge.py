import math

import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.records import Verdict
from gcore_rl.rewards.judge import (
    JudgeConfig,
    VerdictStats,
    combine_rewards,
    parse_verdict,
    summarise_verdicts,
)
from gcore_rl.rewards.judge_template import render_judge_prompt

CFG = JudgeConfig()


# --- config validation -------------------------------------------------------------------------


def test_default_config_validates():
    cfg = JudgeConfig()
    assert cfg.validate() is None  # raises ConfigError when invalid
    assert not cfg.enabled and "{completion}" in cfg.template


def test_enabled_requires_model_path():
    with pytest.raises(ConfigError) as exc:
        JudgeConfig(enabled=True).validate()
    assert exc.value.key == "model_path"
    JudgeConfig(enabled=True, model_path="/models/judge").validate()


@pytest.mark.parametrize(
    "template",
    [
        "Q:{prompt} A:{completion} {reference}",  # unknown field
        "{completion} {0}",  # positional field
        "{completion} {}",  # auto-numbered field
        "{completion} {prompt.upper}",  # attribute access
        "{completion} {prompt:>10}",  # format spec
        "{completion} {prompt!r}",  # conversion
        "{completion} {prompt",  # unbalanced brace
        "{completion} }",  # lone closing brace
        "Q:{prompt} score:",  # no {completion}
    ],
)
def test_bad_template_is_config_error(template):
    with pytest.raises(ConfigError) as exc:
        JudgeConfig(template=template).validate()
    assert exc.value.key == "template"


def test_template_with_answer_and_escaped_braces_validates():
    template = "{{json}} Q:{prompt} ref:{answer} A:{completion}"
    assert JudgeConfig(template=template).validate() is None  # raises ConfigError when invalid
    assert render_judge_prompt(template, "p", "c", answer="7") == "{json} Q:p ref:7 A:c"


@pytest.mark.parametrize("pattern", [r"score:(\d+", r"score:\d+", "[", r"(?P<x"])
def test_bad_pattern_is_config_error(pattern):
    with pytest.raises(ConfigError) as exc:
        JudgeConfig(verdict_pattern=pattern).validate()
    assert exc.value.key == "verdict_pattern"


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"score_min": 5.0, "score_max": 5.0}, "score_max"),
        ({"score_min": 10.0, "score_max": 1.0}, "score_max"),
        ({"score_max": math.inf}, "score_max"),
        ({"score_min": math.nan}, "score_min"),
        ({"unparsed_score": 1.5}, "unparsed_score"),
        ({"unparsed_score": -0.1}, "unparsed_score"),
        ({"weight": math.nan}, "weight"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
    ],
)
def test_bad_numbers_are_config_errors(kwargs, key):
    with pytest.raises(ConfigError) as exc:
        JudgeConfig(**kwargs).validate()
    assert exc.value.key == key


# --- template rendering ------------------------------------------------------------------------


def test_render_default_template():
    assert render_judge_prompt(CFG.template, "2+2?", "4") == "Q:2+2? A:4 score:"


def test_render_answer_missing_is_empty():
    t = "Q:{prompt} ref:[{answer}] A:{completion}"
    assert render_judge_prompt(t, "p", "c") == "Q:p ref:[] A:c"
    assert render_judge_prompt(t, "p", "c", answer="42") == "Q:p ref:[42] A:c"


def test_render_braces_in_texts_are_literal():
    prompt = 'Return {"a": 1} and {prompt} and {0} and {'
    completion = "}{completion}{{}}"
    out = render_judge_prompt(CFG.template, prompt, completion)
    assert out == f"Q:{prompt} A:{completion} score:"


def test_render_escaped_braces_in_template_and_repeated_fields():
    t = "{{x}} {completion}|{completion}"
    assert render_judge_prompt(t, "p", "c") == "{x} c|c"


def test_render_unknown_field_raises_config_error():
    with pytest.raises(ConfigError) as exc:
        render_judge_prompt("{completion} {oops}", "p", "c")
    assert exc.value.key == "template"


# --- verdict parsing ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, score, reward",
    [
        ("score: 7", 7.0, 0.7),
        ("score:7.5", 7.5, 0.75),
        ("Score = 4", 4.0, 0.4),
        ("SCORE:10", 10.0, 1.0),
        ("score: 0", 0.0, 0.0),
        ("score: 12", 12.0, 1.0),  # clamped high
        ("score: -3", -3.0, 0.0),  # clamped low
        ("The answer is fine. score: 2 and later score: 9", 2.0, 0.2),  # first match wins
        ("\u2603\ufffd\x00 score: 5 \U0001f600", 5.0, 0.5),  # unicode junk around it
        ("x" * 100_000 + " score: 3 " + "y" * 100_000, 3.0, 0.3),  # very long text
    ],
)
def test_parse_valid(text, score, reward):
    v = parse_verdict(text, CFG)
    assert v.parsed is True
    assert v.score == score
    assert v.reward == pytest.approx(reward)
    assert v.text == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "no number here",
        "42",  # a number but no 'score' label
        "score: abc",
        "score: nan",
        "score: inf",
        "score:",
        "\u2603\ufffd\x00\U0001f600 \u0441\u0447\u0451\u0442: 5",  # unicode junk, no match
        "z" * 200_000,
    ],
)
def test_parse_unparsed(text):
    v = parse_verdict(text, CFG)
    assert v == Verdict(score=None, reward=0.0, parsed=False, text=text)


def test_unparsed_uses_config_value():
    cfg = JudgeConfig(unparsed_score=0.25)
    assert parse_verdict("nothing", cfg).reward == 0.25
    assert parse_verdict("score: 10", cfg).reward == 1.0


def test_custom_range_and_pattern():
    cfg = JudgeConfig(verdict_pattern=r"rating\s*(\S+)\s*/", score_min=1.0, score_max=5.0)
    assert parse_verdict("Rating 3/5", cfg).reward == pytest.approx(0.5)
    assert parse_verdict("rating 1/5", cfg).reward == 0.0
    assert parse_verdict("rating 0.5/5", cfg).reward == 0.0
    # group captures non-numbers or non-finite values: unparsed
    assert parse_verdict("rating abc/5", cfg).parsed is False
    assert parse_verdict("rating nan/5", cfg).parsed is False
    assert parse_verdict("rating -inf/5", cfg).parsed is False
    # first match decides even when a later one would parse
    assert parse_verdict("rating x/5 rating 4/5", cfg).parsed is False


def test_optional_group_not_taken_is_unparsed():
    cfg = JudgeConfig(verdict_pattern=r"verdict(?::\s*(\d+))?")
    assert parse_verdict("verdict: 6", cfg).reward == pytest.approx(0.6)
    assert parse_verdict("verdict pending", cfg).parsed is False


# --- summaries ---------------------------------------------------------------------------------


def test_summarise_verdicts():
    verdicts = [parse_verdict(t, CFG) for t in ["score: 10", "score: 5", "junk", "score: 12"]]
    stats = summarise_verdicts(verdicts)
    assert stats == VerdictStats(count=4, unparsed=1, mean_reward=pytest.approx((1.0 + 0.5 + 0.0 + 1.0) / 4))


def test_summarise_empty():
    assert summarise_verdicts([]) == VerdictStats(count=0, unparsed=0, mean_reward=0.0)


# --- combining rewards -------------------------------------------------------------------------


def test_combine_weighted_sum():
    out = combine_rewards(
        {"rule": [1.0, 0.0, 1.0], "judge": [0.5, 0.25, 0.0]},
        {"rule": 2.0, "judge": 0.5, "unused": 100.0},
    )
    assert out == pytest.approx([2.25, 0.125, 2.0])


def test_combine_single_and_empty():
    assert combine_rewards({"judge": [0.2, 0.8]}, {"judge": -1.0}) == pytest.approx([-0.2, -0.8])
    assert combine_rewards({}, {}) == []
    assert combine_rewards({"a": [], "b": []}, {"a": 1.0, "b": 1.0}) == []


def test_combine_length_mismatch_names_component():
    with pytest.raises(ValueError, match="'judge'"):
        combine_rewards({"rule": [1.0, 0.0], "judge": [0.5]}, {"rule": 1.0, "judge": 1.0})


def test_combine_missing_weight_names_component():
    with pytest.raises(ValueError, match="'rm'.*no weight"):
        combine_rewards({"rule": [1.0], "rm": [0.5]}, {"rule": 1.0})


def test_combine_non_finite_weight():
    with pytest.raises(ValueError, match="'rule'"):
        combine_rewards({"rule": [1.0]}, {"rule": math.nan})
