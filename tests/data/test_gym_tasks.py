"""reasoning-gym tasks as prompt rows: deterministic, disjoint over shards and from the held-out rows,
chat rows through the template, the task's scorer as the default reward, and clear errors."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from gcore_rl.config import load_job_config  # noqa: E402
from gcore_rl.data.config import DataConfig  # noqa: E402
from gcore_rl.data.gym_tasks import gym_task_rows  # noqa: E402
from gcore_rl.data.sources import load_eval_rows, load_prompt_rows  # noqa: E402
from gcore_rl.errors import ConfigError, DataError  # noqa: E402
from gcore_rl.rewards.ecosystem import GYM_SCORER, reasoning_gym_score  # noqa: E402

TASK = "reasoning_gym:basic_arithmetic"
OPTIONS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2, "operators": ["+", "-"],
           "allow_parentheses": False, "allow_negation": False}


def data(**kw) -> DataConfig:
    return DataConfig(**{"task": TASK, "task_options": OPTIONS, "num_prompts": 40, "eval_prompts": 16, **kw})


def test_rows_are_the_generator_items_and_deterministic():
    rows = gym_task_rows(TASK, 5, seed=3, options=OPTIONS)
    assert rows == gym_task_rows(TASK, 5, seed=3, options=OPTIONS)
    assert rows != gym_task_rows(TASK, 5, seed=4, options=OPTIONS)
    for row in rows:
        assert row["prompt"].startswith("Calculate ") and row["task"] == TASK
        assert eval(row["prompt"].removeprefix("Calculate ").rstrip(".")) == int(row["answer"])  # the sum is right
        assert row["metadata"]["source_dataset"] == "basic_arithmetic"


def test_shards_build_only_their_rows_and_never_overlap():
    whole = load_prompt_rows(data(), 0, 1)
    shards = [load_prompt_rows(data(), k, 3) for k in range(3)]
    assert sum(len(s) for s in shards) == len(whole) == 40
    assert [row for k in range(3) for row in shards[k]] != whole  # interleaved, not blocks
    for k, shard in enumerate(shards):
        assert shard == whole[k::3]


def test_held_out_rows_come_from_another_seed():
    train = {row["prompt"] for row in load_prompt_rows(data(num_prompts=400), 0, 1)}
    held = load_eval_rows(data(num_prompts=400), 0, 1)
    assert len(held) == 16 and held != load_prompt_rows(data(num_prompts=16), 0, 1)
    assert load_eval_rows(data(), 1, 2) == held[1::2]
    assert len({row["prompt"] for row in held} - train) > 0


def test_chat_rows_hold_the_question_and_the_answer_turn():
    row = gym_task_rows(TASK, 1, seed=0, options={**OPTIONS, "chat": 1})[0]
    plain = gym_task_rows(TASK, 1, seed=0, options=OPTIONS)[0]
    assert "prompt" not in row
    assert row["messages"] == [{"role": "user", "content": plain["prompt"]},
                               {"role": "assistant", "content": plain["answer"]}]


def test_the_task_scorer_scores_its_rows():
    row = gym_task_rows(TASK, 1, seed=0, options=OPTIONS)[0]
    fields = {k: v for k, v in row.items() if k != "prompt"}
    assert reasoning_gym_score(row["prompt"], f" {row['answer']}\n", **fields) == 1.0
    assert reasoning_gym_score(row["prompt"], str(int(row["answer"]) + 1), **fields) == 0.0
    with pytest.raises(ValueError, match="reasoning_gym:NAME"):
        reasoning_gym_score("q", "1", answer="1", task="addition")


def test_the_default_rewards_become_the_task_scorer_and_explicit_ones_stay():
    job = load_job_config(None, [f"data.task={TASK}"])
    assert [rule.fn for rule in job.reward.rules] == [GYM_SCORER] and job.reward.accuracy_fn == GYM_SCORER
    chosen = load_job_config(None, [f"data.task={TASK}", "reward.rules=[{fn: gcore_rl.rewards.builtin:digit_accuracy}]"])
    assert [rule.fn for rule in chosen.reward.rules] == ["gcore_rl.rewards.builtin:digit_accuracy"]
    assert load_job_config(None, []).reward.accuracy_fn == "gcore_rl.rewards.builtin:exact_match"


def test_unknown_names_and_rejected_options_are_named():
    with pytest.raises(DataError, match="did you mean reasoning_gym:basic_arithmetic"):
        gym_task_rows("reasoning_gym:basic_arithmetc", 1, seed=0)
    with pytest.raises(DataError, match=r"rejected its options min_terms=5, max_terms=2 .*max_terms must be >= min_terms"):
        gym_task_rows(TASK, 1, seed=0, options={"min_terms": 5, "max_terms": 2})
    with pytest.raises(DataError, match="chat must be 0 or 1"):
        gym_task_rows(TASK, 1, seed=0, options={"chat": 2})
    with pytest.raises(ConfigError, match="data.task|task"):
        data(task_options={"digits": 2}).validate()
