"""Smoke runs of the `gcore-rl` command line in subprocesses: exit codes, messages and run outputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from cli_helpers import NO_STOP, RECIPE, SHORT, assert_user_error, gcore_rl, init_tiny
from transformers import AutoModelForCausalLM, AutoTokenizer

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny model written by the real `init-tiny` command (shared by the tests below)."""
    return init_tiny(tmp_path_factory.mktemp("cli"))


def test_init_tiny_writes_a_loadable_model_and_tokenizer(tiny):
    model = AutoModelForCausalLM.from_pretrained(tiny, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny, local_files_only=True)
    assert model.config.hidden_size == 32
    assert model.config.num_hidden_layers == 2
    assert model.config.intermediate_size == 64
    text = "12 + 34 = 46"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character, spaces included
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_config_reference_lists_keys(tmp_path):
    proc = gcore_rl("config-reference", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "algo.kl_coef" in proc.stdout
    assert "sampling.n" in proc.stdout


# ---------------------------------------------------------------------------------------------- real runs


def test_tiny_training_run_writes_config_metrics_and_final_model(tmp_path, tiny):
    out = tmp_path / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", "run.steps=2", "data.eval_prompts=8",
                    f"run.output_dir={out}", *SHORT, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # before the run, once: where its outputs go; each file it names is there afterwards
    assert proc.stdout.count("outputs of this run:") == 1
    assert proc.stdout.index("outputs of this run:") < proc.stdout.index("done: 2 steps")
    for name in ("metrics.jsonl", "report.html", "final"):
        assert str(out / name) in proc.stdout and (out / name).exists(), name
    assert "checkpoints  off (run.checkpoint_every=0)" in proc.stdout

    saved = load_config(JobConfig, out / "config.yaml")
    requested = load_config(JobConfig, RECIPE, [f"model.path={tiny}", "run.steps=2", "data.eval_prompts=8",
                                                f"run.output_dir={out}", *SHORT])
    assert saved == requested
    assert saved.run.steps == 2 and saved.sampling.n == 4

    lines = (out / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    records = [json.loads(line) for line in lines]
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        for key in ("reward/mean", "entropy", "grad_norm", "time/rollout", "util/rollout/busy_s", "throughput/tokens_per_s",
                    "clip_fraction", "response_length/mean"):
            assert isinstance(record.get(key), float), (key, record)
        assert record["response_length/mean"] > 0
        assert record["throughput/tokens_per_s"] > 0
    assert "eval/accuracy" in records[-1]

    model = AutoModelForCausalLM.from_pretrained(out / "final", local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(out / "final", local_files_only=True)
    prompt = tokenizer("12+34=", return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        generated = model.generate(**prompt, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert generated.shape[1] > prompt["input_ids"].shape[1]


BAD_REWARD = '''
def boom(prompt, completion, **row):
    raise ValueError("reward exploded")
'''


@pytest.fixture
def bad_reward_dir(tmp_path) -> Path:
    (tmp_path / "badreward.py").write_text(BAD_REWARD)
    return tmp_path


def test_raising_reward_function_exits_1_naming_it(bad_reward_dir, tiny):
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", "reward.rules.0.fn=badreward:boom", "run.steps=1", NO_STOP,
                    "data.eval_prompts=0", f"run.output_dir={bad_reward_dir / 'run'}", *SHORT,
                    cwd=bad_reward_dir, extra_pythonpath=bad_reward_dir)
    assert_user_error(proc, 1, "badreward:boom", "reward exploded")


def test_raising_reward_function_with_on_error_assign_is_counted(bad_reward_dir, tiny):
    out = bad_reward_dir / "run"
    proc = gcore_rl("train", RECIPE, f"model.path={tiny}", "reward.rules.0.fn=badreward:boom",
                    "reward.on_error=assign", "run.steps=1", "data.eval_prompts=0", NO_STOP, "run.save_final=false",
                    f"run.output_dir={out}", *SHORT, cwd=bad_reward_dir, extra_pythonpath=bad_reward_dir)
    assert proc.returncode == 0, proc.stderr
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert record["reward/errors"] > 0
    assert record["reward/mean"] == 0.0  # every sample got error_value
