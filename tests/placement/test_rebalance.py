import pytest

from gcore_rl.errors import ConfigError
from gcore_rl.placement.rebalance import (
    RebalanceConfig,
    RolloutLoad,
    feasible_splits,
    mean_load,
    model_error_by_split,
    predict_rollout_seconds,
    rebalance,
)


def test_predicted_phase_is_the_slower_of_generation_and_scoring():
    load = RolloutLoad(generate_s=12.0, score_s=6.0)
    assert predict_rollout_seconds(load, 4, 4) == 3.0  # 12/4 vs 6/4
    assert predict_rollout_seconds(load, 2, 6) == 6.0  # 12/2 vs 1
    assert predict_rollout_seconds(load, 6, 2) == 3.0  # 2 vs 6/2
    assert predict_rollout_seconds(RolloutLoad(5.0, 0.0), 1, 1) == 5.0


def test_slow_judge_moves_devices_to_the_judge():
    # 8 devices, 4/4: generation 8 device-seconds, judging 24
    load = RolloutLoad(generate_s=8.0, score_s=24.0, swap_s=0.1)
    decision = rebalance([load], 4, 8, RebalanceConfig())
    # candidates: T(1)=max(8, 3.43)=8, T(2)=max(4, 4)=4, T(3)=max(2.67, 4.8)=4.8, T(4)=6
    assert decision.rollout_devices == 2
    assert decision.moved == -2
    assert decision.current_s == pytest.approx(6.0)
    assert decision.predicted_s == pytest.approx(4.0)


def test_slow_generation_moves_devices_to_rollout():
    decision = rebalance([RolloutLoad(generate_s=30.0, score_s=2.0)], 2, 8, RebalanceConfig(max_units=8))
    assert decision.rollout_devices == 7  # T(7) = max(4.29, 2) ; T(6) = max(5, 1) is worse
    assert decision.predicted_s == pytest.approx(30 / 7)
    assert rebalance([RolloutLoad(generate_s=30.0, score_s=2.0)], 2, 8, RebalanceConfig()).rollout_devices == 4  # 2 units


def test_balanced_load_stays_put():
    decision = rebalance([RolloutLoad(generate_s=10.0, score_s=10.0)], 4, 8, RebalanceConfig())
    assert decision.rollout_devices == 4 and decision.moved == 0


def test_hysteresis_ignores_small_gains():
    # 40 devices, 20/20: T(20) = max(42/20, 38/20) = 2.1 ; T(21) = max(2.0, 38/19 = 2.0) = 2.0: a 4.8% gain
    load = RolloutLoad(generate_s=42.0, score_s=38.0)
    decision = rebalance([load], 20, 40, RebalanceConfig(min_gain=0.05))
    assert decision.rollout_devices == 20 and "hysteresis" in decision.reason
    assert rebalance([load], 20, 40, RebalanceConfig(min_gain=0.04)).rollout_devices == 21


def test_swap_cost_must_be_paid_back():
    load = RolloutLoad(generate_s=8.0, score_s=24.0, swap_s=5.0)  # gain 2 s per step
    assert rebalance([load], 4, 8, RebalanceConfig(amortize_steps=2.0)).rollout_devices == 4  # 4 s < 5 s swap
    assert rebalance([load], 4, 8, RebalanceConfig(amortize_steps=3.0)).rollout_devices == 2  # 6 s > 5 s


def test_moves_in_units_of_tensor_parallel_size():
    load = RolloutLoad(generate_s=8.0, score_s=24.0)
    decision = rebalance([load], 4, 8, RebalanceConfig(unit=4))
    assert decision.rollout_devices == 4  # the only other split (0) leaves the policy nothing
    decision = rebalance([load], 6, 12, RebalanceConfig(unit=3))
    assert decision.rollout_devices == 3  # T(3) = max(2.67, 2.67)
    assert feasible_splits(4, 8, 2) == [2, 4, 6]
    assert feasible_splits(5, 8, 2) == [1, 3, 5, 7]
    assert feasible_splits(4, 8, 1, min_rollout=2, min_reward=3) == [2, 3, 4, 5]


def test_never_below_what_a_model_needs():
    load = RolloutLoad(generate_s=1.0, score_s=100.0)
    assert rebalance([load], 4, 8, RebalanceConfig(), min_rollout=3).rollout_devices == 3
    load = RolloutLoad(generate_s=100.0, score_s=1.0)
    assert rebalance([load], 4, 8, RebalanceConfig(), min_reward=2).rollout_devices == 6


def test_window_averages_recent_steps_and_does_not_thrash():
    a, b = RolloutLoad(8.0, 24.0), RolloutLoad(24.0, 8.0)
    assert mean_load([a, b, a], 2) == RolloutLoad(16.0, 16.0)
    # alternating measurements average out: the split stays where it is
    history = []
    split = 4
    for step in range(10):
        history.append(a if step % 2 else b)
        if step >= 1:
            split = rebalance(history, split, 8, RebalanceConfig(window=2)).rollout_devices
            assert split == 4


def test_converges_and_then_stays():
    load = RolloutLoad(generate_s=8.0, score_s=24.0, swap_s=0.2)
    split, history = 4, []
    splits = []
    for _ in range(5):
        history.append(load)
        split = rebalance(history, split, 8, RebalanceConfig()).rollout_devices
        splits.append(split)
    assert splits == [2, 2, 2, 2, 2]


def test_no_history_keeps_the_split():
    assert rebalance([], 3, 8, RebalanceConfig()).rollout_devices == 3


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match="unit"):
        RebalanceConfig(unit=0).validate()
    with pytest.raises(ConfigError, match="min_gain"):
        RebalanceConfig(min_gain=1.5).validate()


def test_fixed_per_device_time_does_not_shrink_with_more_devices():
    # measured at 4 + 4: the rollout devices were busy 5 s each, of which 4 s (the slowest) are fixed
    load = RolloutLoad.from_devices(generate_busy=[5.0, 5.0, 5.0, 5.0], generate_fixed=[4.0, 4.0, 4.0, 4.0],
                                    score_busy=[8.0, 8.0, 8.0, 8.0], score_fixed=[0.5, 0.5, 0.5, 0.5])
    assert (load.generate_s, load.score_s, load.rollout_devices) == (4.0, 30.0, 4)
    assert predict_rollout_seconds(load, 4, 4) == pytest.approx(max(4 + 1, 0.5 + 7.5))
    assert predict_rollout_seconds(load, 2, 6) == pytest.approx(max(4 + 2, 0.5 + 5))
    # a divisible-work model (no fixed part) would also take a third device from generation: T(1) = max(20, 4.8)
    decision = rebalance([load], 4, 8, RebalanceConfig())
    assert decision.rollout_devices == 2 and decision.predicted_s == pytest.approx(6.0)
    tail_bound = RolloutLoad.from_devices([10.0] * 4, [9.0] * 4, [2.0] * 4, [0.2] * 4)  # generation is all tail
    assert rebalance([tail_bound], 4, 8, RebalanceConfig()).rollout_devices == 4


def test_only_the_slowest_device_holds_the_tail():
    # one device holds the longest response (fixed 4 s), the others finish earlier: their work divides
    load = RolloutLoad.from_devices([5.0, 3.0, 3.0, 3.0], [4.0, 1.0, 1.0, 1.0], [2.0] * 4, [0.1] * 4)
    assert (load.generate_s, load.generate_fixed_s) == (1.0 + 2.0 * 3, 4.0)
    assert predict_rollout_seconds(load, 2, 6) == pytest.approx(4.0 + 7.0 / 2)


def _measured(split: int, phase_s: float, generate: float = 8.0, score: float = 24.0) -> RolloutLoad:
    return RolloutLoad(generate_s=generate, score_s=score, phase_s=phase_s, rollout_devices=split)


def test_a_move_the_measurement_contradicts_is_undone_and_not_repeated():
    # model: T(4) = max(8/4, 24/4) = 6, T(2) = max(4, 4) = 4, T(3) = max(2.67, 4.8) = 4.8
    history = [_measured(4, 6.0)]  # measured as predicted: ratio 1 at 4
    assert rebalance(history, 4, 8, RebalanceConfig()).rollout_devices == 2
    history.append(_measured(2, 6.6))  # but 2 ran at 6.6 s, not 4 s: ratio 1.65 there
    back = rebalance(history, 2, 8, RebalanceConfig())
    assert back.rollout_devices == 4 and back.current_s == pytest.approx(6.6) and back.predicted_s == pytest.approx(6.0)
    history.append(_measured(4, 6.0))
    nxt = rebalance(history, 4, 8, RebalanceConfig())
    assert nxt.rollout_devices == 3  # 2 stays corrected to 6.6 s; 3 was never measured: 4.8 s x the ratio at 4
    assert nxt.predicted_s == pytest.approx(4.8)


def test_model_error_compares_each_step_with_its_own_load():
    # the work doubles between steps (longer responses): the same split measured twice as long is no worse
    history = [_measured(4, 6.0), _measured(4, 12.0, generate=16.0, score=48.0), _measured(2, 4.4)]
    assert model_error_by_split(history, 8, memory=8) == pytest.approx({4: 1.0, 2: 1.1})
    assert model_error_by_split(history, 8, memory=1) == pytest.approx({2: 1.1})  # older steps forgotten
    assert model_error_by_split([RolloutLoad(8.0, 24.0)], 8, memory=8) == {}  # no measurement, no correction


def test_no_further_in_a_direction_that_measured_no_faster():
    # D = 8; the model keeps saying "fewer rollout devices" (T(4) = 6, T(3) = 4.8, T(2) = 4)
    history = [_measured(4, 6.0), _measured(3, 4.8 * 1.3)]  # 3 ran 30% slower than predicted: 6.24 s corrected
    nxt = rebalance(history, 3, 8, RebalanceConfig())
    assert nxt.rollout_devices == 4 and "measured faster" in nxt.reason  # 6.0 < 6.24 x 0.98: back
    history.append(_measured(4, 6.0))
    stay = rebalance(history, 4, 8, RebalanceConfig())
    assert stay.rollout_devices == 4  # 3 measured slower, so 2 (beyond it) is not tried either


def test_a_replayed_forecast_replaces_the_counted_model():
    # busy time says the judge is the bottleneck; the replay of the same work at every split says 6+2 is best
    forecast = (9.0, 7.0, 6.0, 5.0, 4.5, 4.0, 4.2)  # r = 1..7 of a slice of 8
    load = RolloutLoad(generate_s=8.0, score_s=24.0, forecast=forecast, phase_s=5.0, rollout_devices=4)
    assert load.predict(6, 8) == 4.0 and load.predict(2, 8) == 7.0
    decision = rebalance([load], 4, 8, RebalanceConfig(max_units=2))
    assert decision.rollout_devices == 6 and decision.predicted_s == pytest.approx(4.0)
    # without it, the counted model sends devices the other way
    assert rebalance([RolloutLoad(generate_s=8.0, score_s=24.0)], 4, 8, RebalanceConfig()).rollout_devices == 2


def test_forecasts_average_split_by_split_over_the_window():
    a = RolloutLoad(1.0, 1.0, forecast=(4.0, 2.0, 6.0))
    b = RolloutLoad(3.0, 1.0, forecast=(2.0, 4.0, 2.0))
    assert mean_load([a, b], 2).forecast == (3.0, 3.0, 4.0)
    assert mean_load([a, RolloutLoad(1.0, 1.0)], 2).forecast == ()  # a step without one: the counted model
    c = RolloutLoad(1.0, 1.0, forecast=(float("inf"), 6.0, float("inf")))  # splits 1 and 3 not replayed
    assert mean_load([a, c], 2).forecast == (float("inf"), 4.0, float("inf"))  # compared on the same steps only


def test_moves_toward_the_best_split_at_most_max_units_at_a_time():
    # a far target (7 of 8) whose path improves step by step: one unit at a time
    forecast = (9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0)
    decision = rebalance([RolloutLoad(1.0, 1.0, forecast=forecast)], 2, 8, RebalanceConfig(max_units=1))
    assert decision.rollout_devices == 3 and "toward 7" in decision.reason


def test_a_dip_behind_a_plateau_is_reached_in_one_move():
    # the splits within reach gain under the hysteresis; the best split is far: go the whole way
    forecast = (5.0, 5.0, 5.0, 4.99, 4.98, 4.97, 3.0)
    decision = rebalance([RolloutLoad(1.0, 1.0, forecast=forecast)], 2, 8, RebalanceConfig(max_units=1, min_gain=0.05))
    assert decision.rollout_devices == 7 and decision.moved == 5
