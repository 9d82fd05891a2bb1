"""HF math-verify as a rule reward: equivalences worked by hand, its timeouts off (the reward pool bounds
the time, in threads and worker processes where SIGALRM cannot), and the pool's timeout honoured."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("math_verify")

from gcore_rl.records import RewardInput  # noqa: E402
from gcore_rl.rewards.ecosystem import math_verify  # noqa: E402
from gcore_rl.rewards.rule import RewardConfig, RewardFnConfig, RuleRewards  # noqa: E402

EQUIVALENT = [
    ("1/2", "0.5"),                                           # a fraction and its decimal
    ("\\frac{1}{2}", "so the answer is \\boxed{\\frac{2}{4}}"),  # LaTeX, unreduced, boxed
    ("\\sqrt{8}", "$2\\sqrt{2}$"),                             # bare LaTeX reference, simplified surd
    ("5 cm", "\\boxed{5}"),                                    # units stripped
    ("x^2+2x+1", "\\boxed{(x+1)^2}"),                          # polynomials by sympy
    ("42", "First 6*7, so the result is 42"),                 # the last number of plain text
    ("-3", "\\boxed{-3}"),
]
DIFFERENT = [("7", "\\boxed{8}"), ("1/2", "\\boxed{2}"), ("\\frac{1}{3}", "0.33"), ("5", "no answer here"), ("", "5")]


@pytest.mark.parametrize(("answer", "completion"), EQUIVALENT)
def test_equivalent_answers_score_one(answer, completion):
    assert math_verify("Q", completion, answer=answer) == 1.0


@pytest.mark.parametrize(("answer", "completion"), DIFFERENT)
def test_different_answers_score_zero(answer, completion):
    assert math_verify("Q", completion, answer=answer) == 0.0


def test_it_runs_outside_the_main_thread():
    """math-verify's own timeouts use SIGALRM, which raises outside the main thread; ours are off."""
    scores = []
    thread = threading.Thread(target=lambda: scores.append(math_verify("Q", "\\boxed{\\frac{2}{4}}", answer="1/2")))
    thread.start()
    thread.join()
    assert scores == [1.0]


def test_in_the_reward_pool_with_its_timeout():
    cfg = RewardConfig(rules=[RewardFnConfig(fn="gcore_rl.rewards.ecosystem:math_verify")],
                       accuracy_fn="gcore_rl.rewards.ecosystem:math_verify", workers=1, timeout_s=30.0, on_timeout="zero")
    rewards = RuleRewards(cfg)
    try:
        out = rewards([RewardInput(prompt="Q", completion=c, row={"answer": a}) for a, c in [*EQUIVALENT[:3], *DIFFERENT[:2]]])
    finally:
        rewards.close()
    assert list(out.rewards) == [1.0, 1.0, 1.0, 0.0, 0.0]
