"""Resume on another number of controllers: the epoch in progress still visits every prompt exactly once.

A job saves after 2 steps on K controllers and resumes on K' (2 → 1 and 1 → 2, local runtime, real
command line). The data is 24 prompts and a step takes 4, so steps 1-6 are one epoch: going down to
one controller, the prompt logs of the saved run (steps 1-2) and of the resumed run (steps 3-6)
hold every prompt exactly once. Going up, each new shard holds its own rows, and they need not
have drawn equally many before the save: all controllers end the epoch after as many rows as the
one with the fewest left, so no prompt is drawn twice in the epoch, and the rows cut off open the
next one. The trainer state itself reshards through DCP
(tests/training/test_fsdp_two_process.py: 2 trainers saved, 1 and 4 load the same tensors and take
the same next update to 1e-5).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import RECIPE, gcore_rl, init_tiny

PROMPTS = 24
JOB = ["run.prompts_per_step=4", "sampling.n=2", "run.progress=false", "runtime.threads_per_process=1",
       "run.stop_at_eval_accuracy=0", "data.eval_prompts=0", "dynamic_sampling.enabled=false", "run.save_final=false",
       f"data.num_prompts={PROMPTS}", "run.checkpoint_every=2", "model.path=tiny"]


def drawn_rows(out: Path) -> dict[int, list[int]]:
    """Prompt rows of each step, over every controller's log."""
    rows: dict[int, list[int]] = {}
    for path in sorted((out / "prompts").glob("controller-*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            rows.setdefault(record["step"], []).extend(record["rows"])
    return rows


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    init_tiny(root)
    return root


@pytest.mark.parametrize("before, after", [(2, 1), pytest.param(1, 2, marks=pytest.mark.slow)])
def test_the_epoch_in_progress_visits_every_prompt_once_after_a_resume_on_other_controllers(workdir, before, after):
    out = workdir / f"{before}-to-{after}"
    saved = gcore_rl("train", RECIPE, *JOB, f"run.output_dir={out}", "run.steps=2", f"runtime.controllers={before}",
                     cwd=workdir)
    assert saved.returncode == 0, saved.stderr
    resumed = gcore_rl("train", RECIPE, *JOB, f"run.output_dir={out}", "run.steps=6", f"runtime.controllers={after}",
                       "run.resume=auto", cwd=workdir)
    assert resumed.returncode == 0, resumed.stderr
    assert "continuing from" in resumed.stdout
    rows = drawn_rows(out)
    assert sorted(rows) == list(range(1, 7))
    assert all(len(step_rows) == 4 for step_rows in rows.values())
    drawn = [row for step in range(1, 7) for row in rows[step]]
    epoch_end = max(step for step in rows if len(set(sum((rows[s] for s in range(1, step + 1)), []))) == 4 * step)
    epoch = [row for step in range(1, epoch_end + 1) for row in rows[step]]
    assert len(set(epoch)) == len(epoch), "no prompt twice in the epoch"
    if after == 1:
        assert sorted(drawn) == list(range(PROMPTS)), "down to one controller: every prompt of the epoch exactly once"
    else:  # the new shards' unequal remainders are cut to the smallest (here 6 and 10 rows): 3 more steps
        assert epoch_end == 5 and len(epoch) == 20
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 7))
    assert all(m["rollout/logprob_gap_max"] < 1e-4 for m in metrics)  # the resumed engines hold the trainer's weights
