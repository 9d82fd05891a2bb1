import pytest

from gcore_rl.data.tasks import TASK_ALPHABET, TASKS, make_task_rows
from gcore_rl.errors import DataError


@pytest.mark.parametrize("name", sorted(TASKS))
def test_tasks_are_deterministic_per_seed(name):
    a = make_task_rows(name, 50, seed=7)
    b = make_task_rows(name, 50, seed=7)
    c = make_task_rows(name, 50, seed=8)
    assert a == b
    assert a != c
    assert len(a) == 50
    assert all(row["task"] == name for row in a)
    for row in a:
        text = row["prompt"] if "prompt" in row else "".join(turn["content"] for turn in row["messages"])  # chat rows
        assert set(text + row["answer"]) <= set(TASK_ALPHABET)


def test_addition_chat_rows_are_the_addition_rows_as_conversations():
    plain, chat = make_task_rows("addition", 20, seed=5, digits=1), make_task_rows("addition_chat", 20, seed=5, digits=1)
    for row, conversation in zip(plain, chat, strict=True):
        assert [turn["role"] for turn in conversation["messages"]] == ["system", "user", "assistant"]
        assert [turn["content"] for turn in conversation["messages"][1:]] == [row["prompt"], row["answer"]]
        assert conversation["answer"] == row["answer"]
    assert [turn["role"] for turn in make_task_rows("addition_chat", 1, seed=5, system=0)[0]["messages"]] == \
        ["user", "assistant"]


def test_addition_answers_are_sums():
    rows = make_task_rows("addition", 200, seed=0, digits=3)
    for row in rows:
        assert row["prompt"].endswith("=")
        left, right = row["prompt"][:-1].split("+")
        assert 0 <= int(left) <= 999 and 0 <= int(right) <= 999
        assert int(row["answer"]) == int(left) + int(right)
        assert row["answer"] == str(int(left) + int(right))
    # default digits=2 stays within two-digit operands
    for row in make_task_rows("addition", 100, seed=1):
        assert all(int(x) <= 99 for x in row["prompt"][:-1].split("+"))


def test_reversal_answers_and_lengths():
    rows = make_task_rows("reversal", 200, seed=3, min_len=2, max_len=4, alphabet_size=3)
    lengths = set()
    for row in rows:
        assert row["prompt"].endswith(">")
        text = row["prompt"][:-1]
        lengths.add(len(text))
        assert set(text) <= set("abc")
        assert row["answer"] == text[::-1]
    assert lengths == {2, 3, 4}
    defaults = make_task_rows("reversal", 200, seed=3)
    assert {len(r["answer"]) for r in defaults} == {3, 4, 5}


def test_unknown_task_lists_available_names():
    with pytest.raises(DataError) as info:
        make_task_rows("multiplication", 3, seed=0)
    for name in TASKS:
        assert name in str(info.value)


def test_bad_options():
    with pytest.raises(DataError, match="unknown option"):
        make_task_rows("addition", 3, seed=0, width=3)
    with pytest.raises(DataError, match="max_len"):
        make_task_rows("reversal", 3, seed=0, min_len=5, max_len=2)
    with pytest.raises(DataError, match="digits"):
        make_task_rows("addition", 3, seed=0, digits=0)


def test_addition_preferences_pair_the_sum_with_a_wrong_answer_of_each_kind():
    from gcore_rl.data.tasks import JUDGE_MISTAKES

    rows = make_task_rows("addition_preferences", 600, seed=5)
    assert rows == make_task_rows("addition_preferences", 600, seed=5)
    kinds = set()
    for index, row in enumerate(rows):
        assert set(row) == {"prompt", "chosen", "rejected", "answer", "task", "mistake"}, index
        assert row["task"] == "addition_preferences"
        left, right = row["prompt"][:-1].split("+")
        assert row["prompt"].endswith("=") and 0 <= int(left) <= 99 and 0 <= int(right) <= 99
        total = int(left) + int(right)
        assert row["chosen"] == row["answer"] == str(total)
        rejected, kind = row["rejected"], row["mistake"]
        assert rejected != row["chosen"], index
        assert set(rejected) <= set("0123456789")
        kinds.add(kind)
        if kind == "small":
            assert 1 <= abs(int(rejected) - total) <= 3
        elif kind == "tens":
            assert abs(int(rejected) - total) == 10
        elif kind == "digit":
            assert len(rejected) == len(row["chosen"]) and not (len(rejected) > 1 and rejected[0] == "0")
            assert sum(a != b for a, b in zip(rejected, row["chosen"], strict=True)) == 1
        elif kind == "drop":
            assert len(rejected) == len(row["chosen"]) - 1
            assert any(row["chosen"][:i] + row["chosen"][i + 1:] == rejected for i in range(len(row["chosen"])))
        elif kind == "empty":
            assert rejected == ""
        else:
            assert kind == "random" and 0 <= int(rejected) <= 198
    assert kinds == set(JUDGE_MISTAKES)


def test_addition_preferences_digits_option():
    rows = make_task_rows("addition_preferences", 100, seed=0, digits=3)
    assert any(int(x) > 99 for row in rows for x in row["prompt"][:-1].split("+"))
    assert all(row["chosen"] == str(sum(int(x) for x in row["prompt"][:-1].split("+"))) for row in rows)
    with pytest.raises(DataError, match="digits"):
        make_task_rows("addition_preferences", 3, seed=0, digits=0)
    with pytest.raises(DataError, match="unknown option"):
        make_task_rows("addition_preferences", 3, seed=0, min_len=2)


@pytest.mark.parametrize("name", ["addition", "judge_addition", "addition_preferences"])
def test_reverse_writes_every_sum_least_significant_digit_first(name):
    """`reverse=1` changes how numbers are written and nothing else: same questions, same mistakes, digits reversed."""
    plain = make_task_rows(name, 300, seed=4)
    reverse = make_task_rows(name, 300, seed=4, reverse=1)
    assert make_task_rows(name, 300, seed=4, reverse=0) == plain
    number_columns = {"addition": ["answer"], "judge_addition": ["candidate", "total"],
                      "addition_preferences": ["chosen", "rejected", "answer"]}[name]
    for row, flipped in zip(plain, reverse, strict=True):
        assert set(row) == set(flipped)
        for column in number_columns:
            assert flipped[column] == row[column][::-1], (column, row, flipped)
        if name == "judge_addition":
            assert flipped["question"] == row["question"] and flipped["verdict"] == row["verdict"]
            assert f"A:{flipped['candidate']} " in flipped["prompt"]
            assert flipped["answer"] == (row["verdict"] if row["correct"] else f"{row['verdict']} ={row['total'][::-1]}")
        else:
            assert flipped["prompt"] == row["prompt"]
    assert sum(row["answer"] != row["answer"][::-1] for row in reverse) > 100  # most sums are not palindromes
    with pytest.raises(DataError, match="reverse"):
        make_task_rows(name, 3, seed=0, reverse=2)
