"""JudgeRewarder: rendering, generation and parsing of judge verdicts; the `judge_addition` task."""

import re
from collections import Counter
from pathlib import Path

import pytest

from gcore_rl.configlib import apply_overrides, from_dict, load_config
from gcore_rl.data.tasks import JUDGE_MISTAKES, make_task_rows
from gcore_rl.models.loading import quiet_hf_libraries
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.records import RewardInput
from gcore_rl.rewards.judge import JudgeConfig, parse_verdict
from gcore_rl.rewards.judge_role import JudgeRewarder, template_trailing_text
from gcore_rl.rewards.judge_template import render_judge_prompt

quiet_hf_libraries()


def test_judge_addition_rows_are_deterministic_and_balanced():
    a = make_task_rows("judge_addition", 900, seed=3)
    assert a == make_task_rows("judge_addition", 900, seed=3)
    assert a != make_task_rows("judge_addition", 900, seed=4)
    correct = sum(row["correct"] for row in a)
    assert 400 <= correct <= 500
    cfg = JudgeConfig()
    mistakes = Counter()
    for row in a:
        left, right = row["question"][:-1].split("+")
        total = str(int(left) + int(right))
        cand = row["candidate"]
        assert row["prompt"] == render_judge_prompt(cfg.template, prompt=row["question"], completion=cand)
        assert row["total"] == total
        assert row["correct"] == (cand == total) == (row["mistake"] is None)
        assert row["verdict"] == ("10" if row["correct"] else "0")
        # a correct candidate gets the bare verdict; a wrong one the verdict and the correct sum
        assert row["answer"] == ("10" if row["correct"] else f"0 ={total}")
        # the judge's target parses to the verdict after the template's trailing label (the
        # correction after it is ignored) and fits in the judge's default generation budget
        verdict = parse_verdict(template_trailing_text(cfg.template) + row["answer"], cfg)
        assert verdict.parsed and verdict.reward == (1.0 if row["correct"] else 0.0)
        assert len(row["answer"]) + 1 <= cfg.max_new_tokens  # one token per character, plus EOS
        kind = row["mistake"]
        mistakes[kind] += 1
        if kind == "small":
            assert 1 <= abs(int(cand) - int(total)) <= 3
        elif kind == "tens":
            assert abs(int(cand) - int(total)) == 10
        elif kind == "digit":
            assert len(cand) == len(total) and sum(x != y for x, y in zip(cand, total, strict=True)) == 1
            assert len(cand) == 1 or cand[0] != "0"
        elif kind == "drop":
            assert any(total[:i] + total[i + 1 :] == cand for i in range(len(total)))
        elif kind == "empty":
            assert cand == ""
        elif kind == "random":
            assert 0 <= int(cand) <= 198
        else:
            assert kind is None
    assert set(mistakes) == {None, *JUDGE_MISTAKES}
    # the near misses a policy makes (small, tens, digit) are two thirds of the wrong candidates
    near = mistakes["small"] + mistakes["tens"] + mistakes["digit"]
    assert 0.6 <= near / (len(a) - correct) <= 0.73


def test_trailing_text_and_parse():
    assert template_trailing_text("Q:{prompt} A:{completion} score:") == " score:"
    assert template_trailing_text("{completion} {{x}} verdict:") == " {x} verdict:"
    assert template_trailing_text("{prompt}{completion}") == ""


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory):
    path = tmp_path_factory.mktemp("judge") / "base"
    write_tiny_model(path, TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128))
    return path


def test_untrained_judge_gives_one_verdict_per_sample(tiny_base):
    cfg = JudgeConfig(enabled=True, model_path=str(tiny_base), unparsed_score=0.25, max_new_tokens=4)
    judge = JudgeRewarder.from_config(cfg, "cpu")
    samples = [RewardInput(prompt=f"{i}+1=", completion=str(i + 1), row={"answer": str(i + 1)}) for i in range(6)]
    assert "Q:3+1= A:4 score:" == judge.render(samples[3])
    verdicts, stats = judge.score(samples)
    assert len(verdicts) == stats.count == len(samples)
    assert stats.unparsed == sum(not v.parsed for v in verdicts)
    for v in verdicts:
        assert isinstance(v.text, str)
        if not v.parsed:
            assert v.reward == cfg.unparsed_score and v.score is None
        else:
            assert 0.0 <= v.reward <= 1.0
    assert judge.score([]) == ([], stats.__class__(count=0, unparsed=0, mean_reward=0.0))


def test_parse_uses_template_label_not_completion(tiny_base):
    cfg = JudgeConfig(model_path=str(tiny_base))
    judge = JudgeRewarder.from_config(cfg)
    assert judge.parse("10").reward == 1.0 and judge.parse("10").text == "10"
    assert judge.parse(" 0").parsed and judge.parse(" 0").reward == 0.0
    assert judge.parse("score: 7").score == 7.0
    assert not judge.parse("").parsed and not judge.parse("x1").parsed


RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "sft_judge.yaml"


def recipe_init_tiny_overrides() -> list[str]:
    """The ``key=value`` options of the ``gcore-rl init-tiny DIR ...`` command named in the recipe header."""
    match = re.search(r"gcore-rl init-tiny \S+((?: \w+=\S+)*)", RECIPE.read_text(encoding="utf-8"))
    assert match, f"{RECIPE} must name the `gcore-rl init-tiny` command that makes its base model"
    return match.group(1).split()


def test_recipe_names_a_valid_base_model():
    cfg = from_dict(TinyModelConfig, apply_overrides({}, recipe_init_tiny_overrides()))
    assert cfg.num_layers >= 1 and cfg.hidden_size % cfg.num_heads == 0


@pytest.mark.slow
def test_sft_judge_grades_addition(tmp_path):
    """Train the judge exactly as recipes/sft_judge.yaml does and grade held-out rows greedily."""
    from gcore_rl.training.sft import SftConfig, run_sft

    base = tmp_path / "base"
    write_tiny_model(base, from_dict(TinyModelConfig, apply_overrides({}, recipe_init_tiny_overrides())))
    out = tmp_path / "judge"
    cfg = load_config(SftConfig, RECIPE, [f"model.path={base}", f"output_dir={out}", "progress=false"])
    run_sft(cfg)
    judge = JudgeRewarder.from_config(JudgeConfig(enabled=True, model_path=str(out)))
    rows = make_task_rows("judge_addition", 300, seed=99_999, **cfg.data.task_options)
    verdicts, stats = judge.score([RewardInput(r["question"], r["candidate"], {}) for r in rows])
    right = Counter()
    total = Counter(r["mistake"] or "correct" for r in rows)
    for v, r in zip(verdicts, rows, strict=True):
        right[r["mistake"] or "correct"] += v.parsed and (v.reward > 0.5) == r["correct"]
    report = {k: f"{right[k]}/{n}" for k, n in sorted(total.items())}
    assert stats.unparsed <= 3, report
    # measured (1000 held-out rows, the recipe's 5000 steps, 711 s on 2 shared cores): accuracy 0.97; near
    # misses small 0.956, tens 0.946, digit 0.965; correct candidates 0.97; nothing unparsed. With 3000 steps
    # it was 0.86 (small 0.63): the near misses are learned late.
    assert sum(right.values()) / len(rows) >= 0.9, report
    near = ("small", "tens", "digit")
    assert sum(right[k] for k in near) / sum(total[k] for k in near) >= 0.85, report
    assert right["correct"] / total["correct"] >= 0.9, report
