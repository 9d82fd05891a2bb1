"""A vLLM server's Prometheus counters as `EngineStats` (`gcore_rl.rollout.vllm_metrics`), without a server."""

from __future__ import annotations

import pytest

from gcore_rl.costmodel.replay import fit_engine
from gcore_rl.records import EngineRounds
from gcore_rl.rollout.vllm_metrics import BusyClock, ServerCounts, metric_totals, window_stats

EXPOSITION = """# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="policy"} 120.0
vllm:generation_tokens_total{engine="1",model_name="policy"} 30.0
vllm:prompt_tokens_total{engine="0",model_name="policy"} 64.0
vllm:prompt_tokens_cached_total{engine="0",model_name="policy"} 16.0
vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 48.0
vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 2.0
vllm:iteration_tokens_total_count{engine="0",model_name="policy"} 20.0
vllm:iteration_tokens_total_sum{engine="0",model_name="policy"} 214.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="a name"} 6.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="a name"} 2.0
process_open_fds 12.0
"""


def test_metric_totals_sum_each_sample_over_its_label_sets():
    totals = metric_totals(EXPOSITION, ["vllm:generation_tokens_total", "vllm:request_success_total",
                                        "process_open_fds", "vllm:absent"])
    assert totals == {"vllm:generation_tokens_total": 150.0, "vllm:request_success_total": 8.0,
                      "process_open_fds": 12.0, "vllm:absent": 0.0}


def test_server_counts_take_the_counters_and_their_differences():
    counts = ServerCounts.parse(EXPOSITION)
    assert counts == ServerCounts(steps=20, generated=150, prompt=64, cached=16, requests=8)
    earlier = ServerCounts(steps=5, generated=50, prompt=32, cached=0, requests=4)
    assert counts.since(earlier) == ServerCounts(steps=15, generated=100, prompt=32, cached=16, requests=4)
    restarted = ServerCounts(steps=3, generated=9, prompt=4, cached=0, requests=1)  # a new server counts from 0
    assert restarted.since(counts) == restarted


def test_a_window_counts_each_step_as_a_round_of_its_mean_batch_and_duration():
    stats = window_stats(ServerCounts(steps=10, generated=40, prompt=30, cached=6, requests=4), busy_s=2.0,
                         longest=10, calls=1)
    assert (stats.decode_steps, stats.generated_tokens, stats.prefill_tokens, stats.cached_tokens) == (10, 40, 24, 6)
    assert stats.round_batches == [4] * 10 and stats.round_seconds == pytest.approx([0.2] * 10)
    assert (stats.prefill_rows, stats.longest, stats.calls, stats.prefills) == (4, 10, 1, 0)
    assert window_stats(ServerCounts(), 0.0, 0, 0).round_batches == []


def test_windows_of_different_batches_fit_the_engine_line():
    """Probe-like windows (constant batch) timed as step_s + token_s x batch give back both terms."""
    step_s, token_s = 0.01, 0.002
    rounds = EngineRounds()
    for batch in (1, 4, 16):
        steps = 8
        stats = window_stats(ServerCounts(steps=steps, generated=steps * batch), (step_s + token_s * batch) * steps,
                             longest=steps, calls=1)
        rounds = rounds + EngineRounds.of_call(stats.round_batches, stats.round_seconds, stats.decode_steps,
                                               stats.generated_tokens, stats.prefills, stats.prefill_tokens)
    fit = fit_engine(rounds)
    assert fit is not None
    assert fit.step_s == pytest.approx(step_s) and fit.token_s == pytest.approx(token_s)


def test_the_busy_clock_counts_overlapping_requests_once():
    now = [0.0]
    clock = BusyClock(lambda: now[0])
    clock.start()
    now[0] = 1.0
    clock.start()  # a second request while the first is in flight
    now[0] = 3.0
    clock.end()
    now[0] = 4.0
    clock.end()  # busy from 0 to 4, however many were in flight
    now[0] = 10.0  # idle
    clock.start()
    now[0] = 12.0
    assert clock.take() == 6.0  # a request still in flight counts up to now
    now[0] = 13.0
    clock.end()
    assert clock.take() == 1.0 and clock.take() == 0.0
