"""The local runtime with 2 SPMD controller processes runs a whole job end to end."""

from __future__ import annotations

import json

from transformers import AutoModelForCausalLM

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.models.tiny import TinyModelConfig, write_tiny_model
from gcore_rl.runtime.driver import run_job


def test_two_controllers_train_and_export(tmp_path):
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    cfg = load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=2", "run.prompts_per_step=4",
        "sampling.n=2", "sampling.max_new_tokens=4", "data.eval_prompts=6", "run.progress=false",
        "runtime.controllers=2", "runtime.threads_per_process=1", "algo.kl_coef=0.01",
        "engine.max_num_seqs=3", "engine.min_admit=1",  # 4 samples per controller: rows are refilled
    ])
    summary = run_job(cfg)
    assert summary.steps == 2 and summary.eval_accuracy_after is not None
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]  # one writer (controller 0), one line per step
    assert all("kl" in line and line["rollout/logprob_gap_max"] < 1e-4 for line in lines)
    assert all(line["util/actor/busy_s"] > 0 and "util/wait_s" in line and 0 < line["util/busy_fraction"] <= 1
               for line in lines)
    for line in lines:  # the work each device did, which calibration fits costs to (means over devices)
        assert line["work/rollout/tokens"] * 2 == line["rollout/generated_tokens"]  # per device vs summed
        assert line["work/rollout/decode_steps"] >= line["response_length/max"] - 1 and line["work/rollout/prefills"] >= 1
        assert line["work/actor/rows"] == 4 and line["work/actor/optimiser_steps"] == 1 == line["work/actor/micro_batches"]
        assert line["work/actor/prepare_tokens"] == line["work/actor/tokens"] > 0  # single-pass update + one reference pass
        assert line["work/sync/loads"] == 1 and line["work/sync/bytes"] > 0 and line["work/swap/wakes"] >= 1
    for rank in (0, 1):  # every device worker and every controller writes its own timeline
        events = [json.loads(x) for x in (tmp_path / "run" / "timeline" / f"device-{rank}.jsonl").read_text().splitlines()]
        # colocate: the engine releases its weights for training and takes them back at the sync
        assert {e["role"] for e in events} == {"rollout", "actor", "swap"}
        assert {e["step"] for e in events} == {0, 1, 2}  # step 0: the evaluation before training
        own = [json.loads(x) for x in (tmp_path / "run" / "timeline" / f"controller-{rank}.jsonl").read_text().splitlines()]
        assert {e["role"] for e in own} == {"rewards", "wait"} and {e["controller"] for e in own} == {rank}
    assert all(line["memory/engine_released_mib"] > 0 and line["rollout/staleness_max"] == 0 for line in lines)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "final")
    assert sum(p.numel() for p in reloaded.parameters()) > 0


def test_dynamic_sampling_with_two_controllers_pads_and_stays_in_step(tmp_path):
    """Controllers may need different numbers of waves; their FSDP steps must still line up."""
    model = write_tiny_model(tmp_path / "base", TinyModelConfig(hidden_size=32, num_layers=2, intermediate_size=64))
    cfg = load_config(JobConfig, None, [
        f"model.path={model}", f"run.output_dir={tmp_path / 'run'}", "run.steps=3", "run.prompts_per_step=4",
        "sampling.n=4", "sampling.max_new_tokens=3", "data.eval_prompts=0", "run.progress=false",
        "runtime.controllers=2", "runtime.threads_per_process=1",
        "dynamic_sampling.enabled=true", "dynamic_sampling.max_waves=2",
    ])
    run_job(cfg)
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        # a random tiny model almost never adds correctly: groups are all-zero, so every
        # controller uses both waves and pads its batch with masked groups (counts add up over controllers)
        assert line["sampling/waves"] == 2.0
        assert line["sampling/padded_groups"] == 2 * 2.0
        assert line["sampling/generated_groups"] >= 2 * 4.0
        assert line["pg_loss"] == 0.0 and line["grad_norm"] == 0.0
