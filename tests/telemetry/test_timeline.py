"""Timeline events and utilisation figures."""

from __future__ import annotations

import json

import pytest

from gcore_rl.telemetry.metrics import PhaseTimer
from gcore_rl.telemetry.timeline import TimelineRecorder, utilisation


def test_utilisation_splits_wall_time_into_busy_swap_wait_and_idle():
    result = utilisation({"rollout": 3.0, "actor": 4.0, "wait": 1.0, "swap": 0.5}, step_seconds=10.0)
    assert result == pytest.approx({"util/rollout/busy_s": 3.0, "util/actor/busy_s": 4.0, "util/wait_s": 1.0,
                                    "util/swap_s": 0.5, "util/idle_s": 1.5, "util/busy_fraction": 0.7})


def test_recorder_writes_events_for_known_phases_only(tmp_path):
    path = tmp_path / "timeline" / "device-1.jsonl"
    recorder = TimelineRecorder(device=1, path=path)
    timer = PhaseTimer(on_span=recorder.record)
    recorder.begin_step(3)
    for phase in ("rollout/generate", "update/train", "not/a/role/phase"):
        with timer.phase(phase):
            pass
    recorder.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(e["step"], e["device"], e["role"], e["what"]) for e in events] == [
        (3, 1, "rollout", "rollout/generate"), (3, 1, "actor", "update/train")]
    assert all(0 <= e["start"] <= e["end"] for e in events)
    assert set(recorder.utilisation(1.0)) == {"util/rollout/busy_s", "util/actor/busy_s", "util/wait_s",
                                              "util/swap_s", "util/idle_s", "util/busy_fraction"}
