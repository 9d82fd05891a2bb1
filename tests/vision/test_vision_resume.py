"""A vision-language run killed (SIGKILL) while it trains and resumed from its checkpoint repeats the
uninterrupted run's record bit for bit: the prompts' images are drawn again from their rows, the trainer
state reloads into the Qwen2-VL policy, and the data order goes on where it was (issue 20 with issue 14)."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path

from cli_helpers import REPO, SHORT, gcore_rl

from gcore_rl.checkpoint.layout import step_dir

JOB = ["run.steps=6", "run.checkpoint_every=2", "run.eval_every=2", "data.eval_prompts=8", "data.num_prompts=64",
       "data.task_options.size=16", "run.stop_at_eval_accuracy=0", "train.mini_batches=2", *SHORT]
UNTIMED = ("time", "throughput/", "util/", "memory/")
# a graded reward (the share of digits in the answer), so the untrained policy's groups differ and it trains
DIGITS_REWARD = "def fraction(prompt, completion, **row):\n    return sum(c.isdigit() for c in completion) / 4\n"
GRADED = ["reward.rules.0.fn=digits:fraction", "reward.accuracy_fn=digits:fraction"]


def _train(workdir: Path, out: str, *extra: str, fault: str | None = None) -> subprocess.CompletedProcess:
    return gcore_rl("train", REPO / "recipes" / "grpo_vision_shapes.yaml", "model.path=vl", f"run.output_dir={out}",
                    *JOB, *GRADED, *extra, cwd=workdir, extra_pythonpath=workdir, fault=fault)


def _records(out: Path) -> tuple[list[dict], list[dict]]:
    metrics = [{k: v for k, v in json.loads(line).items() if not k.startswith(UNTIMED)}
               for line in (out / "metrics.jsonl").read_text().splitlines()]
    prompts = [json.loads(line) for line in (out / "prompts" / "controller-0.jsonl").read_text().splitlines()]
    return metrics, prompts


def test_a_killed_vision_run_resumes_to_the_same_record(tmp_path):
    made = gcore_rl("init-tiny", "vl", "arch=qwen2_vl", "hidden_size=32", "num_layers=2", "intermediate_size=64",
                    "vision.image_size=16", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    (tmp_path / "digits.py").write_text(DIGITS_REWARD)
    whole = _train(tmp_path, "whole")
    assert whole.returncode == 0, whole.stderr[-3000:]
    expected = _records(tmp_path / "whole")
    assert [m["step"] for m in expected[0]] == [1, 2, 3, 4, 5, 6]
    assert len({m["pg_loss"] for m in expected[0]}) > 1, "the job must train, or equality would prove nothing"

    killed = _train(tmp_path, "killed", fault="train:6")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    resumed = _train(tmp_path, "killed", "run.resume=auto")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # step 4's save is completed at the end of step 5 (by a thread: a kill soon after may find only step 2's)
    assert any(f"continuing from '{step_dir(Path('killed') / 'checkpoints', step)}'" in resumed.stdout
               for step in (2, 4)), resumed.stdout
    assert _records(tmp_path / "killed") == expected
