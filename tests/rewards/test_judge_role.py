"""JudgeRewarder: rendering, generation and parsing of judge verdicts; the `judge_addition` task."""

import pytest
import torch

from gcore_rl.data.config import DataConfig
from gcore_rl.data.tasks import make_task_rows
from gcore_rl.models.loading import ModelConfig, quiet_hf_libraries
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.rewards.judge import JudgeConfig, parse_verdict, render_judge_prompt
from gcore_rl.rewards.judge_role import JudgeRewarder, template_trailing_text
from gcore_rl.rewards.rule import RewardInput

quiet_hf_libraries()


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_judge_addition_rows_are_deterministic_and_balanced():
    a = make_task_rows("judge_addition", 400, seed=3)
    assert a == make_task_rows("judge_addition", 400, seed=3)
    assert a != make_task_rows("judge_addition", 400, seed=4)
    correct = sum(row["correct"] for row in a)
    assert 160 <= correct <= 240
    template = JudgeConfig().template
    kinds = set()
    for row in a:
        left, right = row["question"][:-1].split("+")
        total = str(int(left) + int(right))
        assert row["prompt"] == render_judge_prompt(template, prompt=row["question"], completion=row["candidate"])
        assert row["correct"] == (row["candidate"] == total)
        assert row["answer"] == ("10" if row["correct"] else "0")
        # the judge's target completion parses after the template's trailing label
        verdict = parse_verdict(template_trailing_text(template) + row["answer"], JudgeConfig())
        assert verdict.parsed and verdict.reward == (1.0 if row["correct"] else 0.0)
        if not row["correct"]:
            cand = row["candidate"]
            kinds.add("empty" if cand == "" else "drop" if len(cand) < len(total) else "offset")
    assert kinds == {"empty", "drop", "offset"}


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


@pytest.mark.slow
def test_sft_judge_grades_addition(tmp_path, tiny_base):
    from gcore_rl.training.sft import SftConfig, run_sft

    base = tmp_path / "base"
    write_tiny_model(base)
    out = tmp_path / "judge"
    run_sft(SftConfig(model=ModelConfig(path=str(base)), data=DataConfig(task="judge_addition", num_prompts=4000),
                      output_dir=str(out), steps=300, batch_size=64, lr=2e-3, warmup_steps=20, threads=1,
                      progress=False))
    judge = JudgeRewarder.from_config(JudgeConfig(enabled=True, model_path=str(out)))
    rows = make_task_rows("judge_addition", 300, seed=99_999)
    verdicts, stats = judge.score([RewardInput(r["question"], r["candidate"], {}) for r in rows])
    correct = sum(v.parsed and (v.reward > 0.5) == r["correct"] for v, r in zip(verdicts, rows, strict=True))
    assert stats.unparsed <= 3
    # measured 0.68 (held-out rows; chance is 0.5): the tiny judge learns the easy wrong answers
    # (empty, dropped digit) but not carry-exact sums yet — raise this as the recipe improves
    assert correct / len(rows) >= 0.6
