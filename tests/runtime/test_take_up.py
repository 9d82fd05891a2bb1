"""The driver's side of resuming, on a run folder built by hand: what `take_up` keeps of a run's records."""

from __future__ import annotations

import json

from gcore_rl.config import JobConfig
from gcore_rl.configlib import load_config
from gcore_rl.runtime.resume import take_up


def test_resuming_without_a_checkpoint_starts_fresh_keeping_no_record(tmp_path):
    """`run.resume=auto` with no complete checkpoint (a job restarted after dying before its first save) starts
    afresh: every record of the attempt goes, a diffusion job's step-0 evaluation too, or it would be written twice."""
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": step, "reward/mean": 0.1}) + "\n" for step in (0, 1, 2)))
    (run / "timeline" / "device-0.jsonl").write_text(json.dumps({"step": 1, "phase": "rollout"}) + "\n")
    cfg = load_config(JobConfig, None, [f"run.output_dir={run}", "run.resume=auto"])
    said: list[str] = []
    assert take_up(cfg, say=said.append).run.resume is None
    assert any("starting fresh" in line for line in said)
    assert (run / "metrics.jsonl").read_text() == "" and (run / "timeline" / "device-0.jsonl").read_text() == ""
