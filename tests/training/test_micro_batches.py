"""Token-budget passes (issue 21, item 1): first-fit decreasing, equal pass counts over ranks."""

from __future__ import annotations

import pytest
import torch

from gcore_rl.records import TokenBatch
from gcore_rl.training.micro_batches import equalise, plan_passes


def test_without_a_budget_passes_are_consecutive_runs_of_rows():
    assert plan_passes([5, 1, 9, 2, 7], rows=2, max_tokens=0, packed=True) == [[0, 1], [2, 3], [4]]


def test_packed_budget_fills_passes_first_fit_decreasing():
    # lengths by row: 0:9 1:2 2:7 3:3 4:5 5:4; budget 12, longest first: 9 -> A; 7 -> B; 5 -> B (12);
    # 4 -> C; 3 -> A (12); 2 -> C (6); heaviest first, ties by first row: A (12), B (12), C (6)
    assert plan_passes([9, 2, 7, 3, 5, 4], rows=8, max_tokens=12, packed=True) == [[0, 3], [2, 4], [1, 5]]


def test_padded_budget_counts_rows_times_the_longest():
    # padded: a pass costs rows x its longest row; budget 12: 9 -> A (9); 7 -> B (7); 5 -> B would be
    # 2 x 7 = 14 > 12 -> C (5); 4 -> C (2 x 5 = 10); 3 -> A? 2 x 9 = 18 no, B? 14 no, C? 3 x 5 = 15 no -> D;
    # 2 -> D (2 x 3 = 6); heaviest first: C (10), A (9), B (7), D (6)
    assert plan_passes([9, 2, 7, 3, 5, 4], rows=8, max_tokens=12, packed=False) == [[4, 5], [0], [2], [1, 3]]


def test_a_pass_also_respects_the_row_cap():
    assert plan_passes([1, 1, 1, 1, 1], rows=2, max_tokens=100, packed=True) == [[0, 1], [2, 3], [4]]


def test_every_row_lands_in_exactly_one_pass_within_the_budget():
    lengths = [(7 * i) % 23 + 1 for i in range(40)]
    passes = plan_passes(lengths, rows=6, max_tokens=30, packed=True)
    assert sorted(row for members in passes for row in members) == list(range(40))
    assert all(sum(lengths[r] for r in members) <= 30 and len(members) <= 6 for members in passes)
    # first-fit decreasing is within 11/9 OPT + 6/9 passes; OPT >= total / budget
    assert len(passes) <= 11 / 9 * -(-sum(lengths) // 30) + 6 / 9 + 1


def test_a_row_longer_than_the_budget_is_named():
    with pytest.raises(ValueError, match=r"row 2 has 40 tokens.*max_tokens_per_micro_batch=32"):
        plan_passes([3, 4, 40], rows=8, max_tokens=32, packed=True)


def test_equalise_halves_the_largest_pass_then_pads_with_dummies():
    assert equalise([[0, 1, 2, 3], [4]], 3) == [[0, 1], [2, 3], [4]]
    assert equalise([[0], [1]], 4) == [[0], [1], None, None]
    assert equalise([[0, 1]], 1) == [[0, 1]]


def test_a_pass_is_cropped_to_the_columns_its_rows_fill():
    ids = torch.tensor([[0, 0, 5, 6, 0, 0], [0, 7, 8, 9, 4, 0], [0, 0, 3, 2, 1, 0]])
    mask = (ids != 0).long()
    batch = TokenBatch(input_ids=ids, attention_mask=mask, response_mask=mask.float(),
                       rollout_logprobs=torch.zeros(3, 6), advantages=torch.tensor([1.0, 2.0, 3.0]))
    part, cols = batch.select(torch.tensor([0, 2])).crop()
    assert cols == slice(2, 5)
    assert part.input_ids.tolist() == [[5, 6, 0], [3, 2, 1]]
    assert part.rollout_logprobs.shape == (2, 3) and part.advantages.tolist() == [1.0, 3.0]  # [B] fields stay


def test_planned_passes_count_what_an_update_runs():
    from gcore_rl.training.micro_batches import MicroBatching
    from gcore_rl.training.shapes import update_shape

    budget = MicroBatching(rows=8, max_tokens=12, packed=False)
    assert budget.planned([9, 2, 7, 3, 5, 4]) == 4  # C, A, B, D of test_padded_budget_counts_rows_times_the_longest
    # mini-batches [9, 2, 7] -> {9}, {7}, {2} (2 x 9 and 2 x 7 exceed 12) and [3, 5, 4] -> {5, 4}, {3}: 5, twice
    assert budget.update_passes([9, 2, 7, 3, 5, 4], mini_batches=2, epochs=2) == 10
    for rows, mini_batches, epochs in ((6, 2, 1), (7, 3, 2), (1, 1, 1)):  # without a budget: the row-count shape
        assert MicroBatching(rows=2).update_passes([5] * rows, mini_batches, epochs) == \
            update_shape(rows, 2, mini_batches, epochs)[1]


def test_a_run_counts_its_token_budget_passes(tmp_path):
    """`work/actor/micro_batches` counts the passes the budget made (not row-count micro-batches)."""
    import json

    from gcore_rl.config import JobConfig
    from gcore_rl.configlib import load_config
    from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
    from gcore_rl.runtime.driver import run_job
    from gcore_rl.training.micro_batches import MicroBatching

    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    run = tmp_path / "run"
    cfg = load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={run}", "run.steps=1", "run.prompts_per_step=8", "sampling.n=2",
        "sampling.max_new_tokens=6", "data.eval_prompts=0", "run.progress=false", "runtime.threads_per_process=1",
        "dynamic_sampling.enabled=false", "train.micro_batch_size=16", "train.max_tokens_per_micro_batch=40",
        "train.mini_batches=2"])
    run_job(cfg)
    line = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    lengths = json.loads((run / "lengths" / "controller-0.jsonl").read_text().splitlines()[0])["tokens"]
    batching = MicroBatching(rows=16, max_tokens=40)
    expected = batching.update_passes(lengths, mini_batches=2, epochs=1)
    assert expected > 2  # more than one pass per optimiser step: the budget, not the row cap, cut them
    assert line["work/actor/micro_batches"] == expected
    # two optimiser steps need old log-probs of their own forward: every prepare pass runs the whole batch's plan
    forward_passes = line["work/actor/prepare_tokens"] / line["work/actor/tokens"]
    assert forward_passes >= 1 and line["work/actor/prepare_micro_batches"] == forward_passes * batching.planned(lengths)
