"""`train.sequence_parallel=2` in a run: one controller's two trainer devices share every pass
(Ray, colocate), and the trainer's log-probs still equal the engine's, which prefills its prompts in
chunks of 3 tokens (`engine.prefill_chunk_tokens`) (issue 21, item 4)."""

from __future__ import annotations

import json

import pytest

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.loading import load_causal_lm
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job

pytestmark = pytest.mark.slow  # sequence parallelism on Ray: `make test-slow`

ray = pytest.importorskip("ray")


def test_a_sequence_parallel_run_matches_the_engine_and_exports_a_plain_model(tmp_path):
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, num_heads=4,
                                                                 num_kv_heads=2, intermediate_size=64))
    cfg = load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.prompts_per_step=8",
        "sampling.n=2", "sampling.max_new_tokens=6", "data.eval_prompts=4", "run.progress=false",
        "runtime.kind=ray", "runtime.controllers=1", "runtime.devices_per_controller=2",
        "runtime.threads_per_process=1", "train.sequence_parallel=2", "algo.kl_coef=0.05",
        "dynamic_sampling.enabled=false", "engine.prefill_chunk_tokens=3",
    ])
    summary = run_job(cfg)
    assert summary.steps == 2
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # the engine samples with ordinary attention over chunked prefills; the trainer's Ulysses passes score alike
    assert all(line["rollout/logprob_gap_max"] < 1e-4 for line in lines)
    assert all(line["train/cost_imbalance"] == 1.0 for line in lines)  # one group of 2 holds all rows
    assert all(line["response_length/mean"] > 0 for line in lines)  # the gap is taken over real tokens
    assert all(line["kl"] >= 0.0 for line in lines)
    exported = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert "ulysses" not in json.dumps(exported)
    load_causal_lm(tmp_path / "run" / "final", "float32", "sdpa", "cpu")
    assert not ray.is_initialized()
