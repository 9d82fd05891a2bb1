"""The update's split over the trainer ranks (`phases.trainer_split`): the runtime's own `balance_rows`
over `SequenceCost`, its imbalance against hand-worked cases, and the update priced at the slowest rank."""

from __future__ import annotations

import numpy as np
import pytest
from small_scenario import make_scenario

from gcore_rl.costmodel import cost, phases
from gcore_rl.data.balance import SequenceCost, balance_rows, imbalance
from gcore_rl.errors import ConfigError
from gcore_rl.sim import resolve_job
from gcore_rl.sim.simulator import simulate, workload_steps
from gcore_rl.sim.workload import StepWork

COST = SequenceCost(params=1000.0, layers=2, hidden=8)  # c(L) = 6000 L + 96 L^2


def one_slice_job(*overrides: str):
    """The small scenario on one slice of 2 devices (2 trainer ranks under the time-shared strategies)."""
    return resolve_job(make_scenario("gpus=2", "controllers=1", "placement.rollout_devices=1",
                                     "placement.train_devices=1", *overrides))


def work_of(lengths: list[list[int]], group_size: int = 4) -> StepWork:
    rows = np.asarray(lengths, np.int64)
    return StepWork(step=0, valid_fraction=1.0, waves=(), trained_groups=rows.shape[1] // group_size,
                    valid_groups=rows.shape[1] // group_size, trained_lengths=rows)


def test_a_long_row_by_hand():
    # longest first: 512 to rank 0, a 64 to rank 1, the next 64 to rank 1 (2 c(64) = 1.55 M < c(512) = 28.2 M),
    # which is then full, so the last 64 goes to rank 0: ranks {512, 64} and {64, 64}
    split = phases.split_rows(np.array([[64, 512, 64, 64]]), 2, COST)
    assert COST(64) == 777_216 and COST(512) == 28_237_824
    assert split.cost_imbalance[0] == pytest.approx((28_237_824 + 777_216) / ((28_237_824 + 3 * 777_216) / 2), rel=1e-12)
    assert split.cost_imbalance[0] == pytest.approx(1.8983016782, rel=1e-10)  # 18890 / 9951
    assert split.token_imbalance[0] == pytest.approx(576 / 352, rel=1e-12)  # 512 + 64 against a mean of 704 / 2
    # priced at the slowest rank's share of the cost: 352 tokens x 1.898, where its own tokens are 576
    assert split.slowest_rank_tokens == pytest.approx(352 * 18890 / 9951, rel=1e-12)


def test_fewer_rows_than_ranks_leave_ranks_empty():
    # 2 rows over 4 ranks: padded with 2 empty rows, one row per rank; the longest sets the pace
    split = phases.split_rows(np.array([[100, 300]]), 4, COST)
    assert COST(300) + COST(100) == 12_000_000
    assert split.cost_imbalance[0] == pytest.approx(4 * COST(300) / 12_000_000, rel=1e-12)  # 3.48
    assert split.cost_imbalance[0] == pytest.approx(3.48, rel=1e-12)
    assert split.token_imbalance[0] == pytest.approx(300 / 100, rel=1e-12)  # 300 against 400 / 4


def test_equal_rows_split_evenly():
    split = phases.split_rows(np.full((3, 12), 77), 4, COST)
    np.testing.assert_array_equal(split.cost_imbalance, 1.0)
    np.testing.assert_array_equal(split.token_imbalance, 1.0)
    assert split.slowest_rank_tokens == 3 * 77


def test_the_split_is_the_runtimes_on_a_long_tail():
    """Every slice's imbalance is `imbalance(costs, balance_rows(costs, m))` of its rows, computed directly."""
    rng = np.random.default_rng(7)
    lengths = np.clip(np.rint(300 * np.exp(1.2 * rng.standard_normal((3, 64)))), 8, 8192).astype(np.int64)
    for ranks in (1, 2, 8, 64):
        split = phases.split_rows(lengths, ranks, COST)
        for k, row_lengths in enumerate(lengths.tolist()):
            costs = [COST(length) for length in row_lengths]
            parts = balance_rows(costs, ranks)
            assert split.cost_imbalance[k] == pytest.approx(imbalance(costs, parts), rel=1e-12)
            assert split.token_imbalance[k] == pytest.approx(imbalance(row_lengths, parts), rel=1e-12)
        if ranks == 1:
            np.testing.assert_array_equal(split.cost_imbalance, 1.0)
        else:
            assert (split.cost_imbalance > 1.0).all()
    # one row per rank: each rank carries its row, so the slice's longest row over the mean row
    one_each = phases.split_rows(lengths, 64, COST)
    costs = COST(lengths.astype(np.float64))
    np.testing.assert_allclose(one_each.cost_imbalance, costs.max(axis=1) / costs.mean(axis=1), rtol=1e-12)


def test_the_update_is_priced_at_the_slowest_rank():
    job = one_slice_job()
    work = work_of([[64, 512, 64, 64]])  # one group of 4 rows, 2 trainer ranks
    c, n = job.policy.sequence_cost, job.policy.params
    assert c(512) > 2 * c(64)  # so the ranks are {512, 64} and {64, 64}, as in test_a_long_row_by_hand
    expected_imbalance = (c(512) + c(64)) / ((c(512) + 3 * c(64)) / 2)
    prepare, train = phases.update_seconds(job, work, devices=2, passes=2)
    tokens = 704 / 2 * expected_imbalance  # the slowest rank's share of the slice's 704 tokens
    peak = job.hardware.peak_flops
    # overheads are 0 by default: 2 log-prob passes of 2 N and the training pass of 6 N per priced token
    assert prepare == pytest.approx(2 * 2 * n * tokens / (job.costs.logprob_mfu * peak), rel=1e-12)
    assert train == pytest.approx(6 * n * tokens / (job.costs.train_mfu * peak), rel=1e-12)
    assert train / float(cost.train_seconds(704, job.policy, job.hardware, job.costs, devices=2)) == pytest.approx(
        expected_imbalance, rel=1e-12)  # against an even split of the tokens


def test_an_even_split_prices_the_update_as_before():
    """Rows of one length split evenly: the update costs the slice's tokens over its ranks, the old price."""
    job = one_slice_job()
    work = work_of([[100] * 8])
    prepare, train = phases.update_seconds(job, work, devices=2, passes=1)
    assert train == pytest.approx(float(cost.train_seconds(800, job.policy, job.hardware, job.costs, devices=2)), rel=1e-12)
    assert prepare == pytest.approx(float(cost.logprob_seconds(800, job.policy, job.hardware, job.costs, devices=2)),
                                    rel=1e-12)


def test_every_step_reports_the_predicted_imbalance():
    """`train/cost_imbalance` and `train/token_imbalance` per step: the mean over slices, as the runtime's
    metrics.jsonl averages its controllers; disaggregated splits over its own trainer devices."""
    scenario = make_scenario()
    job, works = resolve_job(scenario), workload_steps(scenario)
    for strategy, ranks in (("colocate", job.slice_devices), ("disaggregated", job.train_devices)):
        result = simulate(scenario, strategy, works=works)
        for record, work in zip(result.steps, works, strict=True):
            expected = []
            for row_lengths in work.trained_lengths.tolist():
                costs = [job.policy.sequence_cost(length) for length in row_lengths]
                parts = balance_rows(costs, ranks)
                expected.append((imbalance(costs, parts), imbalance(row_lengths, parts)))
            cost_mean, token_mean = np.mean(expected, axis=0)
            assert record.features["train/cost_imbalance"] == pytest.approx(cost_mean, rel=1e-12)
            assert record.features["train/token_imbalance"] == pytest.approx(token_mean, rel=1e-12)
            assert record.features["train/cost_imbalance"] > 1.0  # 8 or 16 rows of a long tail per rank


def test_ulysses_all_to_all_by_hand():
    """Qwen2.5-0.5B (hidden 896, 2 key/value heads of 64, 24 layers, bf16) on H100 NVLink (450 GB/s a
    direction): a group of 2 sharing 704 tokens holds 352 each and sends half of every token's
    q, k, v and attention output, 2 x 896 + 2 x 2 x 64 = 2048 values = 4096 bytes, per layer and pass:
    352 x 1/2 x 4096 x 24 layers x 2 passes = 34,603,008 bytes, over 450e9 B/s."""
    job = one_slice_job()
    seconds = float(cost.ulysses_seconds(704, job.policy, job.hardware, group=2, passes=2))
    assert seconds == pytest.approx(34_603_008 / 450e9, rel=1e-12)
    assert float(cost.ulysses_seconds(704, job.policy, job.hardware, group=1, passes=2)) == 0.0


def test_sequence_parallel_shares_the_long_row():
    """With 2 devices as one sequence-parallel group every device computes half of all 704 tokens (no
    imbalance: one data-parallel rank), plus the all-to-alls; without it the rank holding the 512-token
    row sets the pace (cost imbalance 1.898), so here sequence parallelism is the faster update."""
    plain, shared = one_slice_job(), one_slice_job("strategies=[colocate]", "workload.sequence_parallel=2")
    work = work_of([[64, 512, 64, 64]])
    prepare, train = phases.update_seconds(shared, work, devices=2, passes=2)
    n, peak, c = shared.policy.params, shared.hardware.peak_flops, shared.costs
    a2a = 34_603_008 / 450e9  # one forward + one backward over 704 tokens (test_ulysses_all_to_all_by_hand)
    assert train == pytest.approx(6 * n * 352 / (c.train_mfu * peak) + a2a, rel=1e-12)
    assert prepare == pytest.approx(2 * (2 * n * 352 / (c.logprob_mfu * peak) + a2a / 2), rel=1e-12)
    plain_prepare, plain_train = phases.update_seconds(plain, work, devices=2, passes=2)
    assert train < plain_train and prepare < plain_prepare  # 352 tokens + the all-to-alls against 668 tokens


def test_sequence_parallel_on_an_even_split_costs_only_the_all_to_all():
    shared, plain = one_slice_job("strategies=[colocate]", "workload.sequence_parallel=2"), one_slice_job()
    work = work_of([[100] * 8])
    _, train = phases.update_seconds(shared, work, devices=2, passes=1)
    _, plain_train = phases.update_seconds(plain, work, devices=2, passes=1)
    a2a = float(cost.ulysses_seconds(800, shared.policy, shared.hardware, group=2, passes=2))
    assert train == pytest.approx(plain_train + a2a, rel=1e-12)


def test_a_step_reports_the_imbalance_of_the_sequence_parallel_groups():
    """With N = 2 on 4-device slices the runtime splits rows over 2 groups and reports that split."""
    scenario = make_scenario("strategies=[colocate]", "workload.sequence_parallel=2")
    job, works = resolve_job(scenario), workload_steps(scenario)
    result = simulate(scenario, "colocate", works=works)
    for record, work in zip(result.steps, works, strict=True):
        split = phases.trainer_split(job, work, job.slice_devices // 2)
        assert record.features["train/cost_imbalance"] == pytest.approx(float(split.cost_imbalance.mean()), rel=1e-12)


def test_heads_come_from_the_config_when_head_dim_is_set_apart():
    """A config whose heads x head_dim is not hidden (Qwen3-0.6B: hidden 1024, 16 heads of 128): the
    head check and the all-to-all width use its 16 heads, not hidden / head_dim = 8."""
    from gcore_rl.costmodel.models import ModelSpec
    config = {"num_hidden_layers": 28, "hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "intermediate_size": 3072, "vocab_size": 151936, "tie_word_embeddings": True,
              "model_type": "qwen3"}
    spec = ModelSpec.from_hf_config(config)
    assert spec.query_heads == 16 and ModelSpec("m", 1.0, 1, 1024, 8, 128, 10).query_heads == 8
    job = one_slice_job()
    seconds = float(cost.ulysses_seconds(2, spec, job.hardware, group=2, passes=1))
    # 2 tokens over 2 devices: each sends half of its one token's (2 x 16 + 2 x 8) x 128 values, 2 bytes each, 28 layers
    assert seconds == pytest.approx(28 * 0.5 * 48 * 128 * 2 / 450e9, rel=1e-12)


@pytest.mark.parametrize("overrides, said", [
    (("workload.sequence_parallel=4",), "heads (14)"),  # Qwen2.5-0.5B: 14 heads, 2 key/value heads
    (("workload.sequence_parallel=2", "workload.images.per_prompt=1", "workload.images.sides=[448]"),
     "vision-language"),
    (("workload.sequence_parallel=0",), "at least 1"),
    (("gpus=6", "strategies=[colocate]", "workload.sequence_parallel=2"), "devices of a slice (3)"),
    (("strategies=[disaggregated]", "placement.train_devices=1", "workload.sequence_parallel=2"),
     "placement.train_devices (1)"),
])
def test_bad_sequence_parallel_names_its_key(overrides, said):
    with pytest.raises(ConfigError) as err:
        make_scenario(*overrides)
    assert "sequence_parallel" in err.value.key and said in str(err.value)
