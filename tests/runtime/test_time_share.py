"""`runtime.time_share=false`: on a colocated device nothing sleeps (no swaps), and the run is the time-shared
run's, metric for metric: the engine's weights are refilled in place by the same sync."""

from __future__ import annotations

import json

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job


def _metrics(run) -> list[dict]:
    """Each step's metrics without those that measure time, memory or the machine (`util/`, `memory/`, `time/`,
    `throughput/`, seconds) or count the swaps themselves (`work/swap/`)."""
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k.split("/")[0] not in ("time", "util", "memory", "throughput")
             and not k.startswith("work/swap/") and not k.endswith("_s")} for line in lines]


def test_a_colocated_run_with_every_model_resident_swaps_nothing_and_learns_the_same(tmp_path):
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    runs = {}
    for share in ("true", "false"):
        runs[share] = run = tmp_path / f"share-{share}"
        run_job(load_config(JobConfig, None, [
            f"model.path={model}", f"run.output_dir={run}", "run.steps=3", "run.prompts_per_step=4", "sampling.n=2",
            "sampling.max_new_tokens=4", "data.eval_prompts=0", "run.progress=false", "runtime.threads_per_process=1",
            "placement.strategy=colocate", f"runtime.time_share={share}", "train.lr=1e-3", "algo.entropy_coef=0.1"]))
    roles = {share: {json.loads(e)["role"] for e in (run / "timeline" / "device-0.jsonl").read_text().splitlines()}
             for share, run in runs.items()}
    assert "swap" in roles["true"] and "swap" not in roles["false"]
    sleeps = {share: [json.loads(line).get("work/swap/sleeps", 0) for line in (run / "metrics.jsonl").read_text().splitlines()]
              for share, run in runs.items()}
    assert sleeps == {"true": [1, 1, 1], "false": [0, 0, 0]}
    shared, resident = _metrics(runs["true"]), _metrics(runs["false"])
    assert len(shared) == 3 and shared == resident
    assert any(line.get("grad_norm", 0) > 0 for line in resident)  # the weights moved, and the engine followed them
